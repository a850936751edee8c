"""int4 projections by batch size against the kernels they replace (CUDA): Llama-3.1-8B's
four projections. At M = 1 the byte GEMV (`_wq_gemv_kernel`), at 4 and 16 the split-K
dequantizing GEMM (`_wq_gemm_kernel`), both against the sliced tensor-core kernel
(`_int4_mma_kernel`) over its configurations (BLOCK_N, BLOCK_M, slices of K, warps,
stages[, splits of K between programs]). From 32 rows the tile kernel
(`_int4_mma_tile_kernel`: BLOCK_N, BLOCK_M, warps, stages[, splits of K]) against the
split-K GEMM (up to 64 rows), dequantize-then-cuBLAS (`_int4_dequantized_matmul`) and
cuBLAS on bf16 weights. CUDA-graph replays, the weights cycling through copies larger
than L2 (as bench.diagnostics.gemv_sweep).

    python -m bench.diagnostics.int4_mma_sweep --out FILE [--rows 1,4,16,32,64,...]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import triton

from bench.common import environment
from bench.diagnostics.gemv_sweep import L2_CYCLE_BYTES, SHAPES, _time_graph, _weights, qg_dequant

MMA_CONFIGS = {  # rows of x -> (BLOCK_N, BLOCK_M, SLICES, warps, stages[, splits of K])
    1: [(16, 8, 4, 4, 3), (16, 8, 8, 4, 3), (32, 8, 4, 4, 3), (16, 8, 4, 4, 3, 2),
        (16, 8, 4, 4, 3, 4), (16, 8, 8, 4, 3, 2), (16, 8, 8, 4, 3, 4), (16, 8, 4, 4, 3, 8),
        (16, 8, 2, 4, 3, 4), (32, 8, 4, 4, 3, 2)],
    4: [(16, 8, 8, 8, 3), (16, 8, 4, 4, 3), (32, 8, 4, 4, 3)],
    16: [(16, 16, 8, 8, 3), (16, 16, 4, 4, 3), (32, 16, 4, 4, 3)],
}
TILE_CONFIGS = {  # rows of x -> (BLOCK_N, BLOCK_M, warps, stages[, splits of K])
    32: [(64, 32, 4, 3), (128, 32, 8, 3), (32, 32, 4, 4)],
    64: [(32, 64, 4, 4), (64, 64, 4, 3), (128, 64, 8, 3)],
    # K split for the narrow projections, whose tiles at 65-256 rows are too few to fill
    # the GPU (int4_path splits o and down at 65-128 rows; above, they go to dense)
    128: [(128, 128, 8, 3), (64, 128, 4, 3), (128, 256, 8, 3), (128, 128, 8, 3, 2),
          (128, 128, 8, 3, 4), (64, 128, 4, 3, 4), (128, 128, 8, 3, 8)],
    256: [(128, 256, 8, 3), (128, 128, 8, 3), (64, 128, 4, 3), (128, 256, 8, 3, 2),
          (128, 256, 8, 3, 4), (128, 256, 8, 3, 8), (128, 128, 8, 3, 4)],
    512: [(128, 256, 8, 3), (128, 128, 8, 3), (128, 256, 8, 3, 2)],
    2048: [(128, 256, 8, 3)],
}
SLICED_LARGE = {32: [(16, 32, 4, 4, 3)], 64: [(16, 64, 2, 4, 3)]}
DENSE_M = (64, 128, 256, 512, 2048)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", default=",".join(str(m) for m in sorted(
        {*MMA_CONFIGS, *TILE_CONFIGS})))
    args = ap.parse_args()
    row_counts = [int(m) for m in args.rows.split(",")]
    from csrc_triton import quant_gemm as qg

    dev = torch.device("cuda")
    rows, t0 = [], time.time()
    for name, (N, K) in SHAPES.items():
        nbytes = N * K // 2
        copies = max(2, int(L2_CYCLE_BYTES // nbytes) + 1)
        ws = _weights("int4", N, K, copies, dev)
        ref_w = qg_dequant("int4", ws[0], N, K)
        dense = ref_w.to(torch.bfloat16)
        group, half = ws[0][3], ws[0][4]
        for M in row_counts:
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            ref = x.float() @ ref_w.t()
            out = torch.empty(M, N, device=dev, dtype=torch.bfloat16)

            def gemv(i):
                q, s, z, _, _ = ws[i]
                bn, bk, wp, _ = qg.gemv_config("int4", half, N, K)
                qg._wq_gemv_kernel[(triton.cdiv(N, bn),)](
                    x, q, s, z, s, out, N, K, q.stride(0), s.stride(0),
                    FORMAT=qg._FORMATS["int4"], GROUP=group, HALF=half, HAS_BIAS=False,
                    BLOCK_N=bn, BLOCK_K=bk, INTERPRETED=False, FLOAT_ZERO=False,
                    num_warps=wp, num_stages=2)
                return out

            def gemm(i):
                q, s, z, _, _ = ws[i]
                return qg._launch_gemm(qg, False, x, q, s, z, "int4", group, half, N)

            variants = [("gemv", gemv)] if M == 1 else []
            path, cfg = qg.int4_path(M, N, K, qg._sm_count(dev))
            variants.append((f"routed: {path} {cfg}", lambda i: qg.int4_gemm(
                x, ws[i][0], ws[i][1], ws[i][2], group)))
            if 1 < M <= 64:
                variants.append(("split-k gemm", gemm))
            for cfg in MMA_CONFIGS.get(M, []) + SLICED_LARGE.get(M, []):
                def mma(i, cfg=cfg):
                    q, s, z, _, _ = ws[i]
                    return qg._launch_int4_mma(qg, False, x, q, s, z, None, group, half, N, cfg)
                variants.append((f"mma {cfg}", mma))
            for cfg in TILE_CONFIGS.get(M, []):
                def tiles(i, cfg=cfg):
                    q, s, z, _, _ = ws[i]
                    return qg._launch_int4_mma(qg, False, x, q, s, z, None, group, half, N,
                                               cfg, tiles=True)
                variants.append((f"tiles {cfg}", tiles))
            if M in DENSE_M:
                def dequant(i):
                    q, s, z, _, _ = ws[i]
                    return qg._int4_dequantized_matmul(qg, False, x, q, s, z, None, group,
                                                       half, N)
                variants += [("dequantize+cublas", dequant),
                             ("cublas bf16", lambda i: torch.nn.functional.linear(x, dense))]
            for label, fn in variants:
                row = {"shape": name, "N": N, "K": K, "M": M, "kernel": label}
                try:
                    got = fn(0).float()
                    row["rel_err"] = float((got - ref).norm() / ref.norm())
                    us = _time_graph(fn, copies if "bf16" not in label else 2)
                    row.update(us=round(us, 2), TBps=round(nbytes / us / 1e6, 3),
                               TFLOPs=round(2 * M * N * K / us / 1e6, 1))
                except Exception as e:  # noqa: BLE001 - a configuration that does not compile
                    row["error"] = repr(e)[-400:]
                rows.append(row)
            done = [r for r in rows if r["shape"] == name and r["M"] == M and "us" in r]
            line = "  ".join(f"{r['kernel']} {r['us']}" for r in sorted(done, key=lambda r: r["us"])[:4])
            print(f"{name:8s} M={M:4d} {variants[0][0]} "
                  f"{next((r['us'] for r in done if r['kernel'] == variants[0][0]), '-')} us | "
                  f"best: {line}  [{time.time() - t0:.0f}s]", flush=True)
        del ws
        torch.cuda.empty_cache()
    json.dump({"benchmark": "int4_mma_sweep", "environment": environment(), "rows": rows},
              open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
