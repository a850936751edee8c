import os, torch
os.environ.setdefault("OMP_NUM_THREADS", "1")
from pathlib import Path
from minivllm import LLM, SamplingParams
from minivllm.default_model import ensure_default_model
llm = LLM(str(ensure_default_model()), device="cpu", max_model_len=1024, max_num_seqs=8, gpu_memory_utilization=0.3)
model = llm.engine.runner.model
H, N, S = {}, {}, {}
def hook(name):
    def f(mod, inp, out):
        x = inp[0].detach().reshape(-1, inp[0].shape[-1]).float()
        if x.shape[0] <= 32: return
        H[name] = H.get(name, 0) + x.t() @ x; N[name] = N.get(name, 0) + x.shape[0]
        S.setdefault(name, []).append(x[::16].clone())
    return f
for n, m in model.named_modules():
    if n.split(".")[-1] in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
        m.register_forward_hook(hook(n))
text = Path("docs/performance.md").read_text()
ids = llm.engine.tokenize(text)[:4096]
wins = [ids[i:i + 512] for i in range(0, len(ids), 512)]
llm.generate([{"prompt_token_ids": w} for w in wins], SamplingParams(max_tokens=1), use_tqdm=False)
torch.save({"H": {k: H[k] / N[k] for k in H}, "S": {k: torch.cat(v) for k, v in S.items()},
            "W": {n: m.weight.detach().clone() for n, m in model.named_modules() if hasattr(m, "weight") and m.weight is not None and m.weight.dim() == 2 and "proj" in n},
            "G": {n: m.weight.detach().clone() for n, m in model.named_modules() if n.endswith("layernorm")},
            "E": model.model.embed_tokens.weight.detach().clone() if hasattr(model, "model") else None},
           ".ab/H.pt")
print({k: N[k] for k in list(N)[:4]}, len(H))
