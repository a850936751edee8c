"""Compile fused.py's _silu_and_mul_kernel with FP8_OUT for sm_90a on the CPU; ptxas -v."""
import os, subprocess, sys, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
sys.path.insert(0, sys.argv[1])
from csrc_triton import fused
block, warps = int(sys.argv[2]), int(sys.argv[3])
fn = fused._silu_and_mul_kernel
fn = getattr(fn, "fn", fn) if not hasattr(fn, "arg_names") else fn
sig = {n: "i32" for n in fn.arg_names}
sig.update(x_ptr="*bf16", out_ptr="*u8", scale_ptr="*fp32")
const = dict(DT=2, BLOCK=block, INTERPRETED=False, FP8_OUT=True, PDL=True)
sig.update({c: "constexpr" for c in const})
sig["sx_d"] = sig["so_d"] = "constexpr"; const["sx_d"] = const["so_d"] = 1
ck = triton.compile(ASTSource(fn, sig, const), target=GPUTarget("cuda", 90, 32),
                    options=dict(num_warps=warps, num_stages=2))
with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
    f.write(ck.asm["ptx"])
ptxas = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")
r = subprocess.run([ptxas, "-arch=sm_90a", "-v", f.name, "-o", "/dev/null"], capture_output=True, text=True)
print(block, warps, [l.strip() for l in r.stderr.splitlines() if "registers" in l or "spill" in l])
