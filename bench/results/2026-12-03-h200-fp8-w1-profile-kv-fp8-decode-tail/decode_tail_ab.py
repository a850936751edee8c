"""One decode-attention layer at batch 64 x context 8192 (Llama-3.1-8B heads, 64-token blocks),
e4m3 and bf16 caches, whichever csrc_triton is first on the path; CUDA-graph replays."""
import json, sys, time
import torch
import csrc_triton
from minivllm.worker.kv_cache import value_cache

HQ, HKV, D, BS = 32, 8, 128, 64
dev = torch.device("cuda")

def make(batch, ctx, dtype, seed=0):
    g = torch.Generator(device=dev).manual_seed(seed)
    per = -(-ctx // BS)
    nb = batch * per + 1
    k = torch.randn((nb, BS, HKV, D), generator=g, device=dev, dtype=torch.bfloat16).to(dtype)
    v = value_cache((nb, BS, HKV, D), dtype, dev)
    v.copy_(torch.randn((nb, BS, HKV, D), generator=g, device=dev, dtype=torch.bfloat16).to(dtype))
    perm = torch.randperm(nb - 1, generator=torch.Generator().manual_seed(seed)) + 1
    bt = perm[: batch * per].view(batch, per).to(torch.int32).to(dev)
    sl = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    q = torch.randn((batch, HQ, D), generator=g, device=dev, dtype=torch.bfloat16)
    return q, k, v, bt, sl

def time_graph(fn, reps=10, iters=7):
    fn(); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay(); torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record(); g.replay(); e1.record(); torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1) * 1000 / reps)
    return sorted(ts)[len(ts) // 2]

label, out_file = sys.argv[1], sys.argv[2]
if len(sys.argv) > 3:
    _orig = csrc_triton._decode_config
    _st = int(sys.argv[3])
    def _cfg(head_dim, dtype, interpreted, cache_dtype=None):
        c = dict(_orig(head_dim, dtype, interpreted, cache_dtype))
        if cache_dtype == torch.float8_e4m3fn:
            c["num_stages"] = _st
        return c
    csrc_triton._decode_config = _cfg
    label += f"_s{_st}"
rows = []
for batch, ctx in [(64, 8192), (64, 1000), (16, 4000)]:
    for dt in ((torch.float8_e4m3fn,) if len(sys.argv) > 3 else (torch.float8_e4m3fn, torch.bfloat16)):
        q, k, v, bt, sl = make(batch, ctx, dt)
        out = torch.empty_like(q)
        counters = torch.zeros(batch * HKV, dtype=torch.int32, device=dev)
        fn = lambda: csrc_triton.paged_attention_decode(q, k, v, bt, sl, D ** -0.5, ctx, out=out,
                                                        counters=counters)
        us = time_graph(fn)
        rows.append(dict(variant=label, batch=batch, ctx=ctx, cache=str(dt).split(".")[-1], us=round(us, 1)))
        print(rows[-1], flush=True)
        del q, k, v, bt, sl, out
        torch.cuda.empty_cache()
with open(out_file, "a") as f:
    for r in rows:
        f.write(json.dumps(r) + "\n")
