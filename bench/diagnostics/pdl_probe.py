"""Probe: does programmatic dependent launch (PDL, Hopper) shorten a chain of batch-1
GEMVs replayed as one CUDA graph?

W2 on Llama-3.1-8B is a chain of ~300 small kernels a token, with ~0.2 ms of gaps between
them (docs/decisions.md, "Batch-1 projections"). With PDL a kernel is launched while the
one before it still runs and waits (griddepcontrol.wait) before reading that kernel's
output; the weights of a GEMV do not depend on it, so their first chunk can be loaded
before the wait. This times Llama-3.1-8B's four projection shapes x 32 layers (14 GB of
bf16 weights, each GEMV reading the previous one's output) as one graph: plain launches,
PDL with the wait first, and PDL with the first weight chunk loaded before the wait. The
`check` field (a sum of the last output) must agree between variants.

    python -m bench.diagnostics.pdl_probe --out FILE

Not yet run on a GPU: written when the device time had run out.
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl


@triton.jit
def gemv(w_ptr, x_ptr, y_ptr, N, K, ROWS: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr,
         PREFETCH: tl.constexpr):
    """y = W x for ROWS rows a program; K a multiple of BK. PDL: wait for the previous
    kernel before reading x, then let the next one launch."""
    pid = tl.program_id(0)
    rows = pid * ROWS + tl.arange(0, ROWS)
    offs = tl.arange(0, BK)
    if PREFETCH:  # weights do not depend on the previous kernel
        w = tl.load(w_ptr + rows[:, None] * K + offs[None, :])
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if not PREFETCH:
        w = tl.load(w_ptr + rows[:, None] * K + offs[None, :])
    x = tl.load(x_ptr + offs)
    acc = w.to(tl.float32) * x.to(tl.float32)[None, :]
    for k in range(BK, K, BK):
        w = tl.load(w_ptr + rows[:, None] * K + (k + offs)[None, :])
        x = tl.load(x_ptr + k + offs)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    tl.store(y_ptr + rows, tl.sum(acc, 1).to(tl.bfloat16))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dev = "cuda"
    shapes = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
    layers = 32
    ws = [[torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.01 for n, k in shapes]
          for _ in range(layers)]
    bufs = [torch.randn(28672, device=dev, dtype=torch.bfloat16) for _ in range(2)]
    res = []
    for name, pdl, pre in (("plain", False, False), ("pdl", True, False),
                           ("pdl+prefetch", True, True), ("plain", False, False)):
        try:
            res.append(run(name, pdl, pre, ws, bufs))
        except Exception as e:  # noqa: BLE001
            res.append({"variant": name, "error": repr(e)[:400]})
        print(res[-1], flush=True)
    from bench.common import environment
    with open(args.out, "w") as f:
        json.dump({"benchmark": "pdl_probe", "environment": environment(), "rows": res}, f,
                  indent=1)


def run(name: str, pdl: bool, pre: bool, ws: list, bufs: list) -> dict:
    def step():
        i = 0
        for layer in ws:
            for w in layer:
                n, k = w.shape
                gemv[(n // 4,)](w, bufs[i % 2], bufs[(i + 1) % 2], n, k, ROWS=4, BK=2048,
                                PDL=pdl, PREFETCH=pre, num_warps=4, launch_pdl=pdl)
                i += 1
    step()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    g.replay()
    torch.cuda.synchronize()
    ms = triton.testing.do_bench(g.replay, warmup=10, rep=200, return_mode="median")
    weight_bytes = sum(w.numel() * w.element_size() for layer in ws for w in layer)
    return {"variant": name, "ms": round(ms, 4),
            "TB_s": round(weight_bytes / ms / 1e9, 2), "check": bufs[0].float().sum().item()}


if __name__ == "__main__":
    main()
