"""Compile the W8A8 kernel (csrc_triton/fp8_mm.py under ROOT) for sm_90a on the CPU and
print its MMAs, its wgmma waits and what ptxas -v says (registers, injected waits).

    PYTHONPATH=<triton 3.6 site> python fp8_mm_waits.py ROOT BM,BN,BK,SPLIT,WARPS,STAGES,SWAP[,PROMOTE]

PROMOTE sets the kernel's PROMOTE_EVERY (128 if not given; a kernel without it ignores it).
"""
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, sys.argv[1])
from csrc_triton import fp8_mm as fm  # noqa: E402

bm, bn, bk, split, warps, stages, swap, *promote = [int(v) for v in sys.argv[2].split(",")]
fn = fm._fp8_mm_kernel
sig = {n: "i32" for n in fn.arg_names}
sig.update(x_ptr="*fp8e4nv", xs_ptr="*fp32", w_ptr="*fp8e4nv", ws_ptr="*fp32",
           bias_ptr="*fp32", out_ptr="*bf16", part_ptr="*fp32", count_ptr="*i32")
const = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, EVEN_K=True, HAS_BIAS=False,
             INTERPRETED=False, PDL=True, SWAP_AB=bool(swap))
if "PROMOTE_EVERY" in fn.arg_names:  # a constexpr: given, as every launch gives it
    const["PROMOTE_EVERY"] = promote[0] if promote else 128
sig.update({c: "constexpr" for c in const})
div = ["x_ptr", "w_ptr", "out_ptr", "part_ptr", "N", "K", "stride_xm", "stride_wn",
       "stride_om", "k_per_split"]
attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in div}
ck = triton.compile(ASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                    options=dict(num_warps=warps, num_stages=stages))
ptx = ck.asm["ptx"]
with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
    f.write(ptx)
ptxas = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")
r = subprocess.run([ptxas, "-arch=sm_90a", "-v", f.name, "-o", "/dev/null"],
                   capture_output=True, text=True)
print(sys.argv[2], "triton", triton.__version__)
print("  MMAs:", len(re.findall(r"wgmma\.mma_async", ptx)),
      sorted(set(re.findall(r"wgmma\.mma_async\.\S+", ptx))))
print("  wgmma.wait_group in order:", re.findall(r"wgmma\.wait_group\.sync\.aligned (\d+)", ptx))
for line in r.stderr.splitlines():
    if "C7517" in line or "registers" in line:
        print("  ptxas:", line.strip())
