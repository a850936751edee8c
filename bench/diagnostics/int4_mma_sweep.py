"""int4 at small batch on the tensor cores against the shipped kernels (CUDA): Llama-3.1-8B's
four projections, at M = 1 the byte GEMV (`_wq_gemv_kernel`, its shipped configuration)
and at M = 4 and 16 the split-K dequantizing GEMM, against `_int4_mma_kernel` over its
configurations (BLOCK_N, blocks a step, warps, stages; a few at M > 1), its nibbles unpacked by inline PTX
or by Triton's own integer operations. CUDA-graph replays, the weights cycling through
copies larger than L2 (as bench.diagnostics.gemv_sweep).

    python -m bench.diagnostics.int4_mma_sweep --out FILE [--quick]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import triton

from bench.common import environment
from bench.diagnostics.gemv_sweep import L2_CYCLE_BYTES, SHAPES, _time_graph, _weights, qg_dequant

CONFIGS = [(16, 2, 1, 4), (16, 4, 1, 4), (32, 2, 1, 4), (32, 4, 1, 3), (32, 2, 2, 4),
           (64, 2, 1, 4), (64, 2, 2, 4), (64, 4, 2, 3), (128, 1, 2, 4), (128, 2, 4, 3),
           (16, 2, 1, 6), (32, 2, 1, 6)]
OPS = [(16, 2, 1, 4), (32, 2, 1, 4)]  # Triton's own integer operations, for comparison
QUICK = [(16, 2, 1, 4), (32, 2, 1, 4), (64, 2, 2, 4)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rows", default="1,4,16")
    args = ap.parse_args()
    from csrc_triton import quant_gemm as qg

    dev = torch.device("cuda")
    configs = QUICK if args.quick else CONFIGS
    rows_m = [int(m) for m in args.rows.split(",")]
    rows, t0 = [], time.time()
    for name, (N, K) in SHAPES.items():
        nbytes = N * K // 2
        copies = max(2, int(L2_CYCLE_BYTES // nbytes) + 1)
        ws = _weights("int4", N, K, copies, dev)
        ref_w = qg_dequant("int4", ws[0], N, K)
        for M in rows_m:
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            ref = x.float() @ ref_w.t()
            out = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
            group, half = ws[0][3], ws[0][4]

            def shipped(i):
                q, s, z, _, _ = ws[i]
                if M == 1:
                    bn, bk, wp = qg.gemv_config("int4", half, N, K)
                    qg._wq_gemv_kernel[(triton.cdiv(N, bn),)](
                        x, q, s, z, s, out, N, K, q.stride(0), s.stride(0),
                        FORMAT=qg._FORMATS["int4"], GROUP=group, HALF=half, HAS_BIAS=False,
                        BLOCK_N=bn, BLOCK_K=bk, INTERPRETED=False, FLOAT_ZERO=False,
                        num_warps=wp, num_stages=2)
                    return out
                return qg._launch_gemm(qg, False, x, q, s, z, "int4", group, half, N)

            variants = [("shipped", shipped)]
            cfgs = [(c, True) for c in (configs if M == 1 else QUICK)]
            cfgs += [(c, False) for c in OPS] if M == 1 and not args.quick else []
            for cfg, asm in cfgs:
                def mma(i, cfg=cfg, asm=asm):
                    q, s, z, _, _ = ws[i]
                    return qg._launch_int4_mma(qg, False, x, q, s, z, None, group, half, N,
                                               cfg, asm=asm)
                variants.append((f"mma{'-asm' if asm else '-ops'} {cfg}", mma))
            for label, fn in variants:
                row = {"shape": name, "N": N, "K": K, "M": M, "kernel": label}
                try:
                    got = fn(0).float()
                    row["rel_err"] = float((got - ref).norm() / ref.norm())
                    us = _time_graph(fn, copies)
                    row.update(us=round(us, 2), TBps=round(nbytes / us / 1e6, 3))
                except Exception as e:  # noqa: BLE001 - a configuration that does not compile
                    row["error"] = repr(e)[-400:]
                rows.append(row)
            done = [r for r in rows if r["shape"] == name and r["M"] == M and "us" in r]
            ship = next((r for r in done if r["kernel"] == "shipped"), None)
            best = min(done, key=lambda r: r["us"])
            print(f"{name:8s} M={M:2d} shipped {ship['us'] if ship else '-':>7} us  best "
                  f"{best['us']:7.1f} us ({best['TBps']:.2f} TB/s) {best['kernel']} "
                  f"err {best['rel_err']:.1e}  [{time.time() - t0:.0f}s]", flush=True)
        del ws
        torch.cuda.empty_cache()
    json.dump({"benchmark": "int4_mma_sweep", "environment": environment(), "rows": rows},
              open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
