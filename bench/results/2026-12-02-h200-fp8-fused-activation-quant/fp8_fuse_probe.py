"""W8A8's activation quantization inside the norm / SiLU x up kernels against the 16-bit
kernel followed by fp8_quantize_rows: Llama-3.1-8B's sizes (hidden 4,096, SwiGLU 14,336),
each variant 20 times in a CUDA graph, the graph replayed 20 times; us per variant. Also
how many e4m3 bytes and scales differ between the two (the compiled kernels' rounding)."""
import json
import os
import sys

import torch

import csrc_triton
from csrc_triton import fused_add_rms_norm, silu_and_mul

E4M3 = torch.float8_e4m3fn


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fp8_fuse_probe_timing import time_graph  # noqa: E402  (the same function, shared
# with silu_fp8_probe.py; as it ran, it was defined here)


rows = []
torch.manual_seed(0)
for T in (64, 256, 1024, 4096, 8192):
    H, I = 4096, 14336
    x = torch.randn(T, H, device="cuda").bfloat16()
    res = torch.randn(T, H, device="cuda").bfloat16()
    w = (torch.rand(H, device="cuda") + 0.5).bfloat16()
    gu = (torch.randn(T, 2 * I, device="cuda") * 4).bfloat16()
    h16, a16 = torch.empty(T, H, device="cuda").bfloat16(), torch.empty(T, I, device="cuda").bfloat16()
    q, s = torch.empty(T, H, device="cuda", dtype=E4M3), torch.empty(T, 1, device="cuda")
    q2, s2 = torch.empty(T, I, device="cuda", dtype=E4M3), torch.empty(T, 1, device="cuda")
    r1, r2 = res.clone(), res.clone()
    variants = {
        "norm then quantize": lambda: csrc_triton.fp8_quantize_rows(
            fused_add_rms_norm(x, r1, w, 1e-6, out=h16)[0]),
        "norm writing e4m3": lambda: fused_add_rms_norm(x, r2, w, 1e-6, out=q, scale_out=s),
        "silu then quantize": lambda: csrc_triton.fp8_quantize_rows(silu_and_mul(gu, out=a16)),
        "silu writing e4m3": lambda: silu_and_mul(gu, out=q2, scale_out=s2),
    }
    row = {"T": T}
    for name, fn in variants.items():
        row[name] = round(time_graph(fn), 2)
    # differences, from fresh inputs
    rr = res.clone()
    fused_add_rms_norm(x, rr, w, 1e-6, out=q, scale_out=s)
    wq, ws = csrc_triton.fp8_quantize_rows(csrc_triton.rms_norm(res + x, w, 1e-6))
    row["norm bytes differing"] = int((q.view(torch.uint8) != wq.view(torch.uint8)).sum())
    row["norm scales differing"] = int((s.view(-1) != ws.view(-1)).sum())
    silu_and_mul(gu, out=q2, scale_out=s2)
    wq2, ws2 = csrc_triton.fp8_quantize_rows(silu_and_mul(gu))
    row["silu bytes differing"] = int((q2.view(torch.uint8) != wq2.view(torch.uint8)).sum())
    row["silu scales differing"] = int((s2.view(-1) != ws2.view(-1)).sum())
    print(row, flush=True)
    rows.append(row)
json.dump({"benchmark": "fp8_fuse_probe", "gpu": torch.cuda.get_device_name(), "rows": rows},
          open(sys.argv[1], "w"), indent=1)
