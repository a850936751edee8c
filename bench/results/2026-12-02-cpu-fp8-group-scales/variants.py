import torch
FP8 = torch.float8_e4m3fn
M = 448.0

def w_base(w):
    w = w.float(); s = (w.abs().amax(1) / M).clamp(min=1e-12)
    return (w / s[:, None]).clamp(-M, M).to(FP8), s

def w_exact(w):  # unquantized weights, stored fp32 with scale 1
    w = w.float(); return w.clone(), torch.ones(w.shape[0])

def a_base(x):
    x = x.float(); s = (x.abs().amax(-1, keepdim=True) / M).clamp(min=1e-12)
    return (x / s).clamp(-M, M).to(FP8), s

def a_exact(x):
    return x.float(), torch.ones(*x.shape[:-1], 1)

WEIGHTS = {"base": w_base, "exact": w_exact}
ACTS = {"base": a_base, "exact": a_exact}

def apply(name, Q):
    """name: none | W:<weights>+A:<acts>"""
    if name == "none":
        return None
    w, a = name.split("+")
    Q.quantize_fp8 = WEIGHTS[w.removeprefix("W:")]
    Q.quantize_activations_fp8 = ACTS[a.removeprefix("A:")]
    return "fp8"

def _rt(w, s):
    return (w / s[:, None]).clamp(-M, M).to(FP8)

def search_scale(w, wt=None, K=32, lo=0):
    """per-row scale from absmax/448 * 2^(k/K), k in [lo, K): least (weighted) squared error"""
    w = w.float(); base = (w.abs().amax(1) / M).clamp(min=1e-12)
    best = bests = None
    for k in range(lo, K):
        s = base * 2 ** (k / K)
        e = (_rt(w, s).float() * s[:, None] - w) ** 2
        if wt is not None: e = e * wt
        e = e.sum(1)
        if best is None: best, bests = e, s.clone()
        else:
            m = e < best; best = torch.where(m, e, best); bests = torch.where(m, s, bests)
    return _rt(w, bests), bests

WEIGHTS["srch32"] = lambda w: search_scale(w, K=32)
WEIGHTS["srch8"] = lambda w: search_scale(w, K=8)

def gptq_fp8(w, h, s, damp=0.01, block=128):
    """GPTQ onto the e4m3 grid with fixed per-row scales s; h [in,in] input second moment."""
    w = w.float().clone(); n, k = w.shape
    h = h.double().clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1; w[:, dead] = 0
    h += damp * torch.diag(h).mean() * torch.eye(k, dtype=h.dtype)
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True).float()
    q = torch.empty(n, k, dtype=FP8)
    for i0 in range(0, k, block):
        i1 = min(i0 + block, k); wb = w[:, i0:i1].clone(); err = torch.zeros_like(wb)
        hb = hinv[i0:i1, i0:i1]
        for j in range(i1 - i0):
            col = wb[:, j]
            qc = (col / s).clamp(-M, M).to(FP8); q[:, i0 + j] = qc
            e = (col - qc.float() * s) / hb[j, j]
            wb[:, j:] -= e[:, None] * hb[j, j:][None, :]
            err[:, j] = e
        w[:, i1:] -= err @ hinv[i0:i1, i1:]
    return q, s

import os
_H = {}
def _load_H(src):
    if src not in _H:
        d = torch.load(f".ab/H_{src}.pt") if src != "dev" else torch.load(".ab/H.pt")["H"]
        _H[src] = d
    return _H[src]

def install_gptq(src, damp=0.01, scale="base"):
    import minivllm.model.loader as LD
    import minivllm.model.quantization as Q
    from torch import nn
    H = _load_H(src)
    def qm(model, method):
        for mname, module in list(model.named_modules()):
            for name in Q.PROJECTIONS:
                lin = getattr(module, name, None)
                if isinstance(lin, nn.Linear):
                    h = H[f"{mname}.{name}"]
                    def qf(w, h=h):
                        s = (w_base(w)[1] if scale == "base" else search_scale(w)[1])
                        return gptq_fp8(w, h, s, damp=damp)
                    Q.quantize_fp8 = qf
                    setattr(module, name, Q.QuantizedLinear.from_linear(lin, method))
    LD.quantize_model = qm

_apply0 = apply
def apply(name, Q):
    if name.startswith("gptq"):
        parts = name.split("+")[0].split(":")  # gptq:src[:damp]
        install_gptq(parts[1], float(parts[2]) if len(parts) > 2 else 0.01)
        Q.quantize_activations_fp8 = ACTS[name.split("+")[1].removeprefix("A:")]
        return "fp8"
    return _apply0(name, Q)

def w_shift(f):
    def q(w):
        w = w.float(); s = (w.abs().amax(1) / M).clamp(min=1e-12) * f
        return (w / s[:, None]).clamp(-M, M).to(FP8), s
    return q
for _k in (1, 2, 4, 8):
    WEIGHTS[f"shift{_k}"] = w_shift(2 ** (_k / 16))

def w_rshift(seed):
    def q(w):
        w = w.float(); g = torch.Generator().manual_seed(seed + w.shape[0] * 7 + int(w[0, :4].abs().sum().item() * 1e6) % 100000)
        f = 2 ** (torch.randint(0, 16, (w.shape[0],), generator=g).float() / 16)
        s = (w.abs().amax(1) / M).clamp(min=1e-12) * f
        return (w / s[:, None]).clamp(-M, M).to(FP8), s
    return q
for _s in range(4):
    WEIGHTS[f"rshift{_s}"] = w_rshift(_s)

def a_shift(f):
    def q(x):
        x = x.float(); s = (x.abs().amax(-1, keepdim=True) / M).clamp(min=1e-12) * f
        return (x / s).clamp(-M, M).to(FP8), s
    return q
ACTS["shift8"] = a_shift(2 ** 0.5)
ACTS["shift4"] = a_shift(2 ** 0.25)

def a_search(K=8):
    def q(x):
        x = x.float(); base = (x.abs().amax(-1, keepdim=True) / M).clamp(min=1e-12)
        best = bs = None
        for k in range(K):
            s = base * 2 ** (k / K)
            e = (((x / s).clamp(-M, M).to(FP8).float() * s - x) ** 2).sum(-1, keepdim=True)
            if best is None: best, bs = e, s
            else:
                m = e < best; best = torch.where(m, e, best); bs = torch.where(m, s, bs)
        return (x / bs).clamp(-M, M).to(FP8), bs
    return q
ACTS["srch8"] = a_search(8)
ACTS["srch4"] = a_search(4)


# per (row, group of G inputs) scales: stored dequantized (fp32, scale 1), so the layer's
# reference path multiplies exactly what the grouped format would hold
def w_group(G):
    def q(w):
        w = w.float(); n, k = w.shape
        pad = (-k) % G
        wp = torch.nn.functional.pad(w, (0, pad)).view(n, -1, G)
        s = (wp.abs().amax(-1, keepdim=True) / M).clamp(min=1e-12)
        deq = ((wp / s).clamp(-M, M).to(FP8).float() * s).view(n, -1)[:, :k]
        return deq, torch.ones(n)
    return q
for _g in (32, 64, 128):
    WEIGHTS[f"grp{_g}"] = w_group(_g)

def a_group(G):
    def q(x):
        x = x.float(); k = x.shape[-1]; pad = (-k) % G
        xp = torch.nn.functional.pad(x, (0, pad)).view(*x.shape[:-1], -1, G)
        s = (xp.abs().amax(-1, keepdim=True) / M).clamp(min=1e-12)
        deq = ((xp / s).clamp(-M, M).to(FP8).float() * s).view(*x.shape[:-1], -1)[..., :k]
        return deq, torch.ones(*x.shape[:-1], 1)
    return q
for _g in (32, 128):
    ACTS[f"grp{_g}"] = a_group(_g)
