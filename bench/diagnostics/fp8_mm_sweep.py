"""W8A8 fp8 matmuls at decode-sized batches (CUDA): the split-K Triton kernel
(csrc_triton/fp8_mm.py) over its configurations against torch._scaled_mm (cuBLAS: what
fp8 takes where csrc_triton.fp8_mm.fp8_mm_config gives way) and cuBLAS on bf16 weights, on
Llama-3.1-8B's four projections. CUDA-graph replays, the weights cycling through copies
larger than L2 (as bench.diagnostics.gemv_sweep). Each configuration's output is checked
against an fp32 product of the same e4m3 numbers, as _scaled_mm's is (max difference
relative to the output's largest value).

    python -m bench.diagnostics.fp8_mm_sweep --out FILE [--rows 48,64,...] [--shapes qkv,o]
        [--quick] [--operands bf16] [--swapped none|also|only]

--swapped also (the default) adds, at up to 64 rows, the tile computed transposed
(SWAP_AB: the weights as the MMA's first operand, x's rows padded to 16, 32 or 64); "only"
times just those.

--operands bf16 asks whether the same split-K kernel would pay for 16-bit weights: bf16
operands with unit scales (the kernel's loads and MMAs take them as they come) against
cuBLAS's bf16 GEMM ("kernel": "bf16_cublas" is then the baseline). The engine does not
route 16-bit weights to it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import torch
import triton

from bench.common import environment
from bench.diagnostics.gemv_sweep import L2_CYCLE_BYTES, SHAPES, _time_graph

ROWS = (48, 64, 96, 128, 192, 256)


def _swapped_configs(M: int, quick: bool):
    """(BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, warps, stages, SWAP_AB) with the tile
    transposed, at up to 64 rows: x's rows padded to 16, 32 or 64, 64 or 128 weight rows."""
    if M > 64:
        return []
    bm = 16 if M <= 16 else 32 if M <= 32 else 64
    stages = [3, 4, 6] if not quick else [4]
    return [(bm, bn, bk, split, 4, st, True)
            for bn, bk, split, st in itertools.product([64, 128], [128, 256], [1, 2, 4, 8],
                                                       stages)]


def _configs(M: int, quick: bool):
    """(BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, warps, stages) to try at M rows."""
    bms = [64, 128] if M > 64 else [64]
    bns = [64, 128, 256]
    splits = [1, 2, 4, 8]
    stages = [3, 4] if not quick else [4]
    out = []
    for bm, bn, split, st in itertools.product(bms, bns, splits, stages):
        out.append((bm, bn, 128, split, 4 if bm == 64 else 8, st))
    out += [(bm, bn, 256, s, 4 if bm == 64 else 8, 3) for bm, bn in ((64, 128), (64, 64), (128, 64))
            if bm <= max(bms) for s in (1, 2, 4)]
    out += [(64, 128, 128, s, 8, 4) for s in (1, 2, 4)]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", default=",".join(map(str, ROWS)))
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--operands", choices=("fp8", "bf16"), default="fp8")
    ap.add_argument("--swapped", choices=("none", "also", "only"), default="also")
    args = ap.parse_args()
    from csrc_triton import fp8_mm
    from minivllm.model.quantization import quantize_activations_fp8, quantize_fp8

    dev = torch.device("cuda")
    rows, t0 = [], time.time()
    for name in args.shapes.split(","):
        N, K = SHAPES[name]
        copies = max(2, int(L2_CYCLE_BYTES // (N * K)) + 1)
        w = torch.randn(N, K, device=dev) * 0.02
        q, s = quantize_fp8(w)
        ws = [(q.clone(), s.clone()) for _ in range(copies)]
        w16 = [w.to(torch.bfloat16) for _ in range(max(2, copies // 2))]
        if args.operands == "bf16":  # the kernel's operands: bf16 weights, unit scales
            ws = [(wi, torch.ones(N, device=dev)) for wi in w16]
        for M in [int(m) for m in args.rows.split(",")]:
            x16 = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            bf16 = _time_graph(lambda i: torch.nn.functional.linear(x16, w16[i]), len(w16))
            rows.append({"shape": name, "N": N, "K": K, "M": M, "kernel": "bf16_cublas",
                         "us": round(bf16, 2)})
            if args.operands == "bf16":
                xq, xs = x16, torch.ones(M, 1, device=dev)
                ref = x16.float() @ w16[0].float().t()
                base = bf16
            else:
                xq, xs = quantize_activations_fp8(torch.randn(M, K, device=dev))
                # fp32 reference: the e4m3 numbers' exact products, summed in fp32
                ref = (xq.float() * xs) @ (q.float() * s[:, None]).t()

                def cublas(i, xq=xq, xs=xs):
                    qi, si = ws[i]
                    return torch._scaled_mm(xq, qi.t(), scale_a=xs, scale_b=si[None, :],
                                            out_dtype=torch.bfloat16)

                err = ((cublas(0).float() - ref).abs().max() / ref.abs().max()).item()
                base = _time_graph(cublas, copies)
                rows.append({"shape": name, "N": N, "K": K, "M": M, "kernel": "scaled_mm",
                             "us": round(base, 2), "rel_err": err})
            best = (base, "cuBLAS")
            configs = [] if args.swapped == "only" else _configs(M, args.quick)
            if args.swapped != "none":
                configs += _swapped_configs(M, args.quick)
            for cfg in configs:

                def kern(i, cfg=cfg):
                    qi, si = ws[i]
                    return fp8_mm._launch(fp8_mm, False, xq, xs, qi, si, None,
                                          torch.bfloat16, cfg)

                try:
                    err = ((kern(0).float() - ref).abs().max() / ref.abs().max()).item()
                    us = _time_graph(kern, len(ws))
                except Exception as e:  # out of shared memory, etc.
                    rows.append({"shape": name, "M": M, "kernel": "triton",
                                 "config": list(cfg), "error": repr(e)[:200]})
                    continue
                rows.append({"shape": name, "N": N, "K": K, "M": M, "kernel": "triton",
                             "config": list(cfg), "us": round(us, 2), "rel_err": err})
                best = min(best, (us, str(cfg)))
            print(f"{name} M={M}: cuBLAS {base:.1f} us, bf16 {bf16:.1f}, best "
                  f"{best[0]:.1f} {best[1]}  ({time.time() - t0:.0f}s)", flush=True)
        with open(args.out, "w") as f:  # after each shape: a cut-short run keeps its rows
            json.dump({"benchmark": "fp8_mm_sweep", "operands": args.operands,
                       "environment": environment(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
