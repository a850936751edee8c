"""Decode attention over an e4m3 cache: the kept kernel against the transposed one, per config.
Llama-3.1-8B heads (32 q / 8 kv, D 128), 64-token blocks; a layer timed as CUDA-graph replays.

    python decode_probe.py OUT_DIR              # the kept kernel's configs (decode_fp8_stages_probe.json)
    python decode_probe.py OUT_DIR transposed   # with transposed_variant.diff applied, which adds the
                                                # transposed=... argument (decode_fp8_transposed_probe.json)
"""
import json, os, sys, time
import torch
import csrc_triton
from minivllm.worker.kv_cache import value_cache

OUT = sys.argv[1]
TRANSPOSED = sys.argv[2:] == ["transposed"]
HQ, HKV, D, BS = 32, 8, 128, 64
dev = torch.device("cuda")
rows = []

def make(batch, ctx, dtype, seed=0):
    g = torch.Generator(device=dev).manual_seed(seed)
    per = -(-ctx // BS)
    nb = batch * per + 1
    k = (torch.randn((nb, BS, HKV, D), generator=g, device=dev, dtype=torch.bfloat16)).to(dtype)
    v = value_cache((nb, BS, HKV, D), dtype, dev)
    v.copy_(torch.randn((nb, BS, HKV, D), generator=g, device=dev, dtype=torch.bfloat16).to(dtype))
    perm = torch.randperm(nb - 1, generator=torch.Generator().manual_seed(seed)) + 1
    bt = perm[: batch * per].view(batch, per).to(torch.int32).to(dev)
    sl = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    q = torch.randn((batch, HQ, D), generator=g, device=dev, dtype=torch.bfloat16)
    return q, k, v, bt, sl

def reference(q, k, v, bt, sl, n=4):
    n = min(n, q.shape[0])
    outs = []
    for b in range(n):
        L = int(sl[b]); blocks = bt[b, : -(-L // BS)].long()
        kk = k[blocks].reshape(-1, HKV, D)[:L].float(); vv = v[blocks].reshape(-1, HKV, D)[:L].float()
        kk = kk.repeat_interleave(HQ // HKV, 1); vv = vv.repeat_interleave(HQ // HKV, 1)
        s = torch.einsum("hd,thd->ht", q[b].float(), kk) * D ** -0.5
        outs.append(torch.einsum("ht,thd->hd", s.softmax(-1), vv))
    return torch.stack(outs)

def time_graph(fn, reps=10, iters=5):
    fn(); torch.cuda.synchronize()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay(); torch.cuda.synchronize()
    best = []
    for _ in range(iters):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record(); g.replay(); e1.record(); torch.cuda.synchronize()
        best.append(e0.elapsed_time(e1) * 1000 / reps)
    best.sort()
    return best[len(best) // 2]

orig_cfg = csrc_triton._decode_config
def run(batch, ctx, dtype, transposed, cfg=None, splits=None):
    q, k, v, bt, sl = DATA[(batch, ctx, dtype)]
    if cfg is not None:
        csrc_triton._decode_config = lambda *a, **kw: dict(BLOCK_N=cfg[0], num_warps=cfg[1], num_stages=cfg[2])
    try:
        out = torch.empty_like(q)
        counters = torch.zeros(batch * HKV, dtype=torch.int32, device=dev)
        extra = dict(transposed=transposed) if TRANSPOSED else {}
        fn = lambda: csrc_triton.paged_attention_decode(q, k, v, bt, sl, D ** -0.5, ctx, out=out,
                                                        num_splits=splits, counters=counters, **extra)
        us = time_graph(fn)
        err = (out[:REF[(batch, ctx, dtype)].shape[0]].float() - REF[(batch, ctx, dtype)]).abs().max().item()
        kvb = batch * ctx * HKV * D * 2 * k.element_size()
        row = dict(batch=batch, ctx=ctx, cache=str(dtype).split(".")[-1], transposed=transposed,
                   config=list(cfg) if cfg else "default", splits=splits or csrc_triton.decode_num_splits(batch, HKV, ctx),
                   us=round(us, 1), TBps=round(kvb / us / 1e6, 2), max_err=round(err, 5))
    except Exception as e:  # a config that does not compile
        row = dict(batch=batch, ctx=ctx, cache=str(dtype), transposed=transposed, config=list(cfg) if cfg else "default",
                   error=repr(e)[:300])
    finally:
        csrc_triton._decode_config = orig_cfg
    print(row, flush=True); rows.append(row)

DATA, REF = {}, {}
points = [(64, 8192), (64, 1024), (1, 8192), (16, 4096)]
O_CONFIGS = [(128, 4, 1), (128, 4, 2), (128, 4, 3), (64, 4, 2), (128, 8, 2), (256, 4, 2), (256, 8, 2), (256, 4, 1)]
T_CONFIGS = [(128, 4, 1), (128, 4, 2), (128, 4, 3), (128, 8, 1), (128, 8, 2), (256, 8, 1), (256, 8, 2),
             (256, 4, 1), (64, 4, 2), (64, 4, 3)]
for (b, c) in points:
    for dt in (torch.float8_e4m3fn, torch.bfloat16):
        DATA[(b, c, dt)] = make(b, c, dt)
        REF[(b, c, dt)] = reference(*DATA[(b, c, dt)])
    run(b, c, torch.bfloat16, False)
    run(b, c, torch.float8_e4m3fn, False)
    if TRANSPOSED:
        for cfg in (T_CONFIGS if (b, c) == (64, 8192) else T_CONFIGS[:3] + [(128, 8, 1), (256, 8, 1)]):
            run(b, c, torch.float8_e4m3fn, True, cfg)
    else:
        for cfg in O_CONFIGS:
            run(b, c, torch.float8_e4m3fn, False, cfg)
    for dt in (torch.float8_e4m3fn, torch.bfloat16):
        del DATA[(b, c, dt)]
    torch.cuda.empty_cache()
json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
               triton=__import__("triton").__version__, commit=os.environ.get("MINIVLLM_GIT_COMMIT"),
               rows=rows), open(f"{OUT}/decode_fp8_{'transposed' if TRANSPOSED else 'stages'}_probe.json", "w"), indent=1)
