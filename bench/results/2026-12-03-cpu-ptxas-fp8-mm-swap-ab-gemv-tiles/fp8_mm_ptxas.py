import sys, os, subprocess, re
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import triton
sys.path.insert(0, sys.argv[1])
from csrc_triton import fp8_mm as fm
bm, bn, bk, split, warps, stages, swap = [int(v) for v in sys.argv[2].split(",")]
fn = fm._fp8_mm_kernel
sig = {n: "i32" for n in fn.arg_names}
sig.update(x_ptr="*fp8e4nv", xs_ptr="*fp32", w_ptr="*fp8e4nv", ws_ptr="*fp32", bias_ptr="*fp32", out_ptr="*bf16", part_ptr="*fp32", count_ptr="*i32")
const = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, EVEN_K=True, HAS_BIAS=False, INTERPRETED=False, PDL=True, SWAP_AB=bool(swap))
sig.update({c: "constexpr" for c in const})
div = ["x_ptr", "w_ptr", "out_ptr", "part_ptr", "N", "K", "stride_xm", "stride_wn", "stride_om", "k_per_split"]
attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in div}
ck = triton.compile(ASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))
ptx = ck.asm["ptx"]
f = "/tmp/fp8mm.ptx"; open(f, "w").write(ptx)
ptxas = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")
r = subprocess.run([ptxas, "-arch=sm_90a", "-v", f, "-o", "/dev/null"], capture_output=True, text=True)
mma = sorted(set(re.findall(r"(wgmma\.mma_async\.\S+|mma\.sync\.\S+)", ptx)))
print(sys.argv[2], "regs", re.findall(r"Used (\d+) registers", r.stderr), "spill", re.findall(r"(\d+) bytes spill stores", r.stderr), "smem", ck.metadata.shared, mma[:3])
