"""The batch-1 GEMV kernel's configurations on Llama-3.1-8B's projection shapes (CUDA):
each (format, shape, BLOCK_N, BLOCK_K, warps, loop stages) timed as CUDA-graph replays with
the weights cycling through copies larger than L2, against the shipped configuration
(csrc_triton.quant_gemm.gemv_config) and cuBLAS bf16. Loop stages above 1 pipeline the
weight loads through shared memory (the kernel's LOOP_STAGES; int4 ignores them).

    python -m bench.diagnostics.gemv_sweep --out FILE [--formats int4,fp8] [--quick]
        [--shapes qkv,o] [--bn 4,8] [--bk 512,1024] [--warps 2,4] [--stages 1,2,3]
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import torch
import triton

from bench.common import environment

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336)}
L2_CYCLE_BYTES = 256 << 20  # weights cycled per replay: several times the 50 MB L2


def _weights(fmt: str, N: int, K: int, copies: int, dev):
    from csrc_triton.int4_layout import int4_half
    from minivllm.model.quantization import quantize_fp8, quantize_int4, quantize_int8

    w = torch.randn(N, K, device=dev) * 0.02
    if fmt == "int4":
        q, s, z = quantize_int4(w, 128)
        one = (q, s, z, 128, int4_half(128, K))
    elif fmt == "fp8":
        q, s = quantize_fp8(w)
        one = (q.view(torch.uint8), s, None, K, 0)
    elif fmt == "int8":
        q, s = quantize_int8(w)
        one = (q, s, None, K, 0)
    else:
        one = (w.to(torch.bfloat16), w.new_ones(N), None, K, 0)
    return [tuple(t.clone() if torch.is_tensor(t) else t for t in one) for _ in range(copies)]


def _time_graph(fn, copies: int, reps: int = 20) -> float:
    """Mean microseconds of one fn(i) call, the graph replaying all copies in turn."""
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for i in range(copies):
            fn(i)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(copies):
            fn(i)
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        for _ in range(reps):
            g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / (reps * copies))
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", required=True)
    ap.add_argument("--formats", default="int4,fp8,w16")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    for axis in ("bn", "bk", "warps", "stages"):
        ap.add_argument(f"--{axis}", default=None, help="comma-separated values of that axis")
    args = ap.parse_args()
    from csrc_triton import quant_gemm as qg

    dev = torch.device("cuda")
    fmts = args.formats.split(",")
    bns, bks, warps, stages = [4, 8, 16], [512, 1024, 2048], [2, 4, 8], [1, 2, 3]
    if args.quick:
        bns, bks, warps, stages = [4, 8], [512, 1024], [2, 4], [1, 3]
    pick = {a: [int(v) for v in getattr(args, a).split(",")] if getattr(args, a) else None
            for a in ("bn", "bk", "warps", "stages")}
    bns, bks = pick["bn"] or bns, pick["bk"] or bks
    warps, stages = pick["warps"] or warps, pick["stages"] or stages
    rows, t0 = [], time.time()
    for fmt in fmts:
        for name in args.shapes.split(","):
            N, K = SHAPES[name]
            bytes_per = {"int4": 0.5, "fp8": 1, "int8": 1, "w16": 2}[fmt] * N * K
            copies = max(2, int(L2_CYCLE_BYTES // bytes_per) + 1)
            ws = _weights(fmt, N, K, copies, dev)
            x = torch.randn(1, K, device=dev, dtype=torch.bfloat16)
            out = torch.empty(1, N, device=dev, dtype=torch.bfloat16)
            ref = (x.float() @ qg_dequant(fmt, ws[0], N, K).t()).float()
            shipped = qg.gemv_config(fmt, ws[0][4], N, K)
            configs = [(*shipped, True)]
            configs += [(bn, bk, wp, st, False) for bn, bk, wp, st
                        in itertools.product(bns, bks, warps, stages if fmt != "int4" else [1])
                        if (bn, bk, wp, st) != shipped]
            for bn, bk, wp, st, is_shipped in configs:
                half = ws[0][4]
                if fmt == "int4" and bk % (2 * half):
                    continue

                def fn(i, bn=bn, bk=bk, wp=wp, st=st):
                    q, s, z, group, half = ws[i]
                    qg._wq_gemv_kernel[(triton.cdiv(N, bn),)](
                        x, q, s, z if z is not None else s, s, out, N, K, q.stride(0),
                        s.stride(0) if fmt == "int4" else 0, FORMAT=qg._FORMATS[fmt],
                        GROUP=group, HALF=half, HAS_BIAS=False, BLOCK_N=bn, BLOCK_K=bk,
                        INTERPRETED=False, FLOAT_ZERO=False, LOOP_STAGES=st, num_warps=wp,
                        num_stages=2)
                try:
                    fn(0)
                    err = ((out.float() - ref).norm() / ref.norm()).item()
                    us = _time_graph(fn, copies)
                except Exception as e:  # noqa: BLE001 - a config that does not compile
                    rows.append({"format": fmt, "shape": name, "BLOCK_N": bn, "BLOCK_K": bk,
                                 "warps": wp, "loop_stages": st, "error": repr(e)[:200]})
                    continue
                rows.append({"format": fmt, "shape": name, "N": N, "K": K, "BLOCK_N": bn,
                             "BLOCK_K": bk, "warps": wp, "loop_stages": st, "shipped": is_shipped,
                             "us": round(us, 2), "TBps": round(bytes_per / us / 1e6, 3),
                             "rel_err": err})
            if fmt == "w16":
                wb = [w[0] for w in ws]
                us = _time_graph(lambda i: torch.nn.functional.linear(x, wb[i]), copies)
                rows.append({"format": "w16", "shape": name, "impl": "cublas",
                             "us": round(us, 2), "TBps": round(bytes_per / us / 1e6, 3)})
            best = min((r for r in rows if r.get("shape") == name and r.get("format") == fmt
                        and "us" in r), key=lambda r: r["us"])
            ship = next(r for r in rows if r.get("shape") == name and r.get("format") == fmt
                        and r.get("shipped"))
            print(f"{fmt:5s} {name:8s} shipped {ship['us']:7.1f} us ({ship['TBps']:.2f} TB/s)"
                  f"  best {best['us']:7.1f} us ({best['TBps']:.2f} TB/s) "
                  f"{best.get('BLOCK_N')}x{best.get('BLOCK_K')} w{best.get('warps')} "
                  f"s{best.get('loop_stages')} {best.get('impl', '')}  [{time.time() - t0:.0f}s]",
                  flush=True)
            del ws
            torch.cuda.empty_cache()
    json.dump({"benchmark": "gemv_sweep", "environment": environment(), "rows": rows},
              open(args.out, "w"), indent=1)


def qg_dequant(fmt, one, N, K):
    from minivllm.model.quantization import dequantize_int4
    q, s, z, group, half = one
    if fmt == "int4":
        return dequantize_int4(q, s, z, K, group).float()
    if fmt == "fp8":
        return q.view(torch.float8_e4m3fn).float() * s[:, None]
    if fmt == "int8":
        return q.float() * s[:, None]
    return q.float()


if __name__ == "__main__":
    main()
