"""SiLU x up writing e4m3 (W8A8's input to the down projection) by tile configuration,
against silu_and_mul's 16 bits followed by fp8_quantize_rows: Llama-3.1-8B's 14,336,
CUDA-graph replays as in fp8_fuse_probe.py. (BLOCK, warps): one tile a row when BLOCK
covers it, else two passes over the row (its maximum, then the bytes)."""
import json
import sys

import torch
import triton

import csrc_triton
from csrc_triton import fused, silu_and_mul
from csrc_triton._pdl import launch_args

sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.abspath(__file__)))
from fp8_fuse_probe_timing import time_graph  # noqa: E402

E4M3 = torch.float8_e4m3fn
rows = []
torch.manual_seed(0)
for T in (256, 1024, 8192):
    I = 14336
    gu = (torch.randn(T, 2 * I, device="cuda") * 4).bfloat16()
    a16 = torch.empty(T, I, device="cuda").bfloat16()
    q, s = torch.empty(T, I, device="cuda", dtype=E4M3), torch.empty(T, 1, device="cuda")
    row = {"T": T, "silu then quantize": round(time_graph(
        lambda: csrc_triton.fp8_quantize_rows(silu_and_mul(gu, out=a16))), 2)}
    want_q, want_s = csrc_triton.fp8_quantize_rows(silu_and_mul(gu))
    for block, warps in ((16384, 16), (16384, 32), (1024, 4), (2048, 4), (2048, 8), (4096, 4), (4096, 8), (8192, 8)):
        def run():
            fused._silu_and_mul_fp8_kernel[(T,)](
                gu, q.view(torch.uint8), s, I, gu.stride(0), gu.stride(1), q.stride(0),
                DT=2, BLOCK=block, ONE_TILE=block >= I, INTERPRETED=False,
                num_warps=warps, enable_fp_fusion=False, **launch_args(gu.device))
        try:
            row[f"{block}/{warps}"] = round(time_graph(run), 2)
            run()
            row[f"{block}/{warps} same"] = bool(torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(s, want_s))
        except Exception as e:  # noqa: BLE001
            row[f"{block}/{warps}"] = repr(e)[-200:]
    print(row, flush=True)
    rows.append(row)
json.dump({"benchmark": "silu_fp8_probe", "gpu": torch.cuda.get_device_name(), "rows": rows},
          open(sys.argv[1], "w"), indent=1)
