"""W1/W6 with kv_cache_dtype=fp8, the prefill kernel's e4m3 config taken from a sweep's best
(attention_tuning summary JSON: 'w1' for prompts, 'w6-mixed' for long ones)."""
import json, sys
import torch
import csrc_triton

sweep, out = sys.argv[1], sys.argv[2]
best = {s["shape"]: s["best"] for s in json.load(open(sweep))["summary"]}
print("configs:", best, flush=True)
orig = csrc_triton._prefill_config

def patched(rows, head_dim, dtype, interpreted, long_ctx=False, long_query=False, cache_dtype=None):
    if cache_dtype == torch.float8_e4m3fn and not interpreted:
        cfg = dict(best["w6-mixed" if long_query else "w1"])
        cfg["BLOCK_M"] = min(cfg["BLOCK_M"], max(16, csrc_triton._next_pow2(rows)))
        return cfg
    return orig(rows, head_dim, dtype, interpreted, long_ctx, long_query, cache_dtype)

csrc_triton._prefill_config = patched
from bench.vs_vllm import main
sys.exit(main(["offline", "--engine", "minivllm", "--model", "llama-3.1-8b", "--workloads", "w1,w6",
               "--kv-cache-dtype", "fp8", "--out", out]))
