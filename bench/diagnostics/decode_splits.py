"""One decode-attention layer (Llama-3.1-8B's heads: 32 query, 8 kv, head_dim 128; the
GPU's 64-token blocks) by KV split count, for the bf16 and e4m3 caches: CUDA-graph
replays of `csrc_triton.paged_attention_decode` with the split combine fused (as in the
engine's decode graphs), block tables shuffled over the pool. Each split count given
runs with a tile as a split's least context; the row with `"plan"` is the launch as the
engine makes it (`decode_split_plan`: the split count and least tokens for that grid).
With `--graph-len N` also the launch the engine's decode graphs make: planned for a grid of
N positions (their `max_model_len`), a sequence's least chunk taken at run time (the row
with `"graph_len"`). Also the compiled kernels' registers and shared memory (they set how
many programs an SM holds).

    python -m bench.diagnostics.decode_splits --out FILE [--points 64x8192,...]
        [--splits 1,2,3,4,8] [--graph-len 8704]
"""

from __future__ import annotations

import argparse
import json

import torch

import csrc_triton
from bench.common import environment
from minivllm.worker.kv_cache import value_cache

HQ, HKV, D, BS = 32, 8, 128, 64


def make_layer(batch: int, ctx: int, dtype: torch.dtype, dev: torch.device, seed: int = 0):
    g = torch.Generator(device=dev).manual_seed(seed)
    per = -(-ctx // BS)
    nb = batch * per + 1
    k = torch.randn((nb, BS, HKV, D), generator=g, device=dev, dtype=torch.bfloat16).to(dtype)
    v = value_cache((nb, BS, HKV, D), dtype, dev)
    v.copy_(torch.randn((nb, BS, HKV, D), generator=g, device=dev,
                        dtype=torch.bfloat16).to(dtype))
    perm = torch.randperm(nb - 1, generator=torch.Generator().manual_seed(seed)) + 1
    tables = perm[: batch * per].view(batch, per).to(torch.int32).to(dev)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    q = torch.randn((batch, HQ, D), generator=g, device=dev, dtype=torch.bfloat16)
    return q, k, v, tables, lens


def replay_us(fn, reps: int = 10, iters: int = 9) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        graph.replay()
        e1.record()
        torch.cuda.synchronize()
        times.append(e0.elapsed_time(e1) * 1000 / reps)
    return sorted(times)[len(times) // 2]


def compiled_kernels() -> list[dict]:
    """Registers and shared memory of each compiled decode-split kernel (best effort:
    Triton's cache layout differs between versions)."""
    out = []
    try:
        for cache in csrc_triton._kernels_for(torch.device("cuda"))._decode_split_kernel \
                .device_caches.values():
            for ck in cache[0].values():
                out.append({"n_regs": getattr(ck, "n_regs", None),
                            "n_spills": getattr(ck, "n_spills", None),
                            "shared": getattr(ck.metadata, "shared", None),
                            "num_stages": getattr(ck.metadata, "num_stages", None)})
    except Exception as exc:  # noqa: BLE001 - diagnostic only
        out.append({"error": repr(exc)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", required=True)
    ap.add_argument("--points", default="64x8192,32x8192,64x4096,128x2048,64x1000,16x4000")
    ap.add_argument("--splits", default="1,2,3,4,8")
    ap.add_argument("--graph-len", type=int, default=0)
    args = ap.parse_args()
    dev = torch.device("cuda")
    points = [tuple(int(v) for v in p.split("x")) for p in args.points.split(",")]
    rows = []
    for batch, ctx in points:
        for dtype in (torch.float8_e4m3fn, torch.bfloat16):
            q, k, v, tables, lens = make_layer(batch, ctx, dtype, dev)
            out = torch.empty_like(q)
            counters = torch.zeros(batch * HKV, dtype=torch.int32, device=dev)
            plan = csrc_triton.decode_split_plan(q, k, v, tables, lens, ctx, counters)
            for splits in [None, *(int(s) for s in args.splits.split(","))]:
                fn = lambda s=splits: csrc_triton.paged_attention_decode(  # noqa: E731
                    q, k, v, tables, lens, D ** -0.5, ctx, out=out, num_splits=s,
                    counters=counters)
                us = replay_us(fn)
                rows.append({"batch": batch, "context": ctx, "cache": str(dtype).split(".")[-1],
                             "splits": splits or plan[0], "us": round(us, 1)}
                            | ({"plan": True, "min_split_tokens": plan[1]} if splits is None
                               else {}))
                print(rows[-1], flush=True)
            if args.graph_len:
                graph_plan = csrc_triton.decode_split_plan(q, k, v, tables, lens, args.graph_len,
                                                           counters)
                us = replay_us(lambda: csrc_triton.paged_attention_decode(
                    q, k, v, tables, lens, D ** -0.5, args.graph_len, out=out,
                    counters=counters))
                rows.append({"batch": batch, "context": ctx, "cache": str(dtype).split(".")[-1],
                             "splits": graph_plan[0], "us": round(us, 1),
                             "graph_len": args.graph_len, "min_split_tokens": graph_plan[1]})
                print(rows[-1], flush=True)
            del q, k, v, tables, lens, out
            torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump({"benchmark": "decode_splits", "environment": environment(),
                   "kernels": compiled_kernels(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
