import torch, sys
sys.path.insert(0, ".ab")
import variants as V
torch.set_num_threads(1)
W = torch.load(".ab/H.pt")["W"]
Hr = torch.load(".ab/H3_readme4.pt"); Hp = torch.load(".ab/H3_perf4.pt")
names = [n for n in W if "layers" in n]
for k in range(0, 16, 1):
    iso = hr = hp = 0.0
    for n in names:
        w = W[n].float(); q, s = V.w_shift(2 ** (k / 16))(w); e = q.float() * s[:, None] - w
        iso += ((e ** 2).sum() / (w ** 2).sum()).item()
        hr += (torch.trace(e @ Hr[n] @ e.t()) / torch.trace(w @ Hr[n] @ w.t())).item()
        hp += (torch.trace(e @ Hp[n] @ e.t()) / torch.trace(w @ Hp[n] @ w.t())).item()
    print(k, f"iso {iso/len(names):.3e} readmeH {hr/len(names):.3e} perfH {hp/len(names):.3e}", flush=True)
