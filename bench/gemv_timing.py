"""Time Qwen2.5-0.5B's projections at batch 1, as a decode step's CUDA graph runs them
(GPU only): F.linear (cuBLAS GEMM, the model's path) against torch.mv (cuBLAS GEMV).

W2 (batch 1) is a chain of ~290 latency-bound kernels. The s2 profile put the projections
at 0.53 ms of a ~0.93 ms step. The down projection alone took a GEMM (5.3 us) plus a
split-K reduce kernel (1.6 us); the HBM floor of its weights is ~2 us. A GEMV kernel needs
no reduce. This says whether a batch-1 branch in the model's projections is worth
building, before it is built.

Each projection runs 24 times in a chain (one weight per layer, so nothing is served from
L2), captured in one CUDA graph and replayed. Times are per call, device time.

    python -m bench.gemv_timing [--out FILE]
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from bench.common import gpu_probe_parser, graph_replay_us, has_cuda, write_result

# (name, in features, out features) of Qwen2.5-0.5B's projections, and its LM head
SHAPES = [("qkv", 896, 1152), ("o", 896, 896), ("gate_up", 896, 9728), ("down", 4864, 896),
          ("lm_head", 896, 151936)]
LAYERS = 24


def timed(fn) -> float:
    return graph_replay_us(fn, n=50, warm=5)


def main(argv=None) -> int:
    ap = gpu_probe_parser(__doc__)
    args = ap.parse_args(argv)
    if not has_cuda("gemv_timing"):
        return 1
    dev, dt = torch.device("cuda"), torch.bfloat16
    rows = []
    for name, k, n in SHAPES:
        layers = 1 if name == "lm_head" else LAYERS
        ws = [torch.randn(n, k, device=dev, dtype=dt) * 0.02 for _ in range(layers)]
        x = torch.randn(1, k, device=dev, dtype=dt)
        out = torch.empty(1, n, device=dev, dtype=dt)

        def gemm():
            for w in ws:
                torch.matmul(x, w.t(), out=out)

        def linear():
            for w in ws:
                F.linear(x, w)

        def gemv():
            for w in ws:
                torch.mv(w, x[0], out=out[0])

        us = {"linear": timed(linear) / layers, "matmul_out": timed(gemm) / layers,
              "mv": timed(gemv) / layers}
        floor = 1e6 * n * k * 2 / 4.28e12  # weight bytes at 4.28 TB/s (the design brief)
        diff = (F.linear(x, ws[0]).float() - torch.mv(ws[0], x[0]).float()).abs().max().item()
        rows.append({"name": name, "in": k, "out": n, "us": {a: round(b, 2) for a, b in us.items()},
                     "hbm_floor_us": round(floor, 2), "max_abs_diff_linear_vs_mv": diff})
        print(f"{name:8s} {k:5d}->{n:6d}  linear {us['linear']:6.2f} us  matmul(out=) "
              f"{us['matmul_out']:6.2f} us  mv {us['mv']:6.2f} us  (floor {floor:.2f} us)")
        ws.clear()  # free this shape's weights before the next
        torch.cuda.empty_cache()
    per_layer = {a: round(sum(r["us"][a] for r in rows if r["name"] != "lm_head"), 2)
                 for a in ("linear", "matmul_out", "mv")}
    print(f"per layer (4 projections): {per_layer}")
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "dtype": "bfloat16", "rows": rows, "per_layer_us": per_layer}
    if args.out:
        write_result("gemv_timing", res, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
