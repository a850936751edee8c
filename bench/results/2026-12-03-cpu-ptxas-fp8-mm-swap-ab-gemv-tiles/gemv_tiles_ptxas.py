import sys, os, subprocess, tempfile, re
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import triton
sys.path.insert(0, sys.argv[1])
from csrc_triton import quant_gemm as qg
which = sys.argv[2]; fmt = int(sys.argv[3]); tiles = int(sys.argv[4])
wt = "*bf16" if fmt == 3 else ("*i8" if fmt == 0 else "*u8")
bn, bk, warps, stages = (4, 2048, 4, 1) if fmt == 3 else (8, 1024, 4, 3 if fmt == 1 else 1)
if which == "plain":
    fn = qg._wq_gemv_kernel
    sig = {n: "i32" for n in fn.arg_names}
    sig.update(x_ptr="*bf16", w_ptr=wt, scale_ptr="*fp32", zero_ptr="*fp32", bias_ptr="*bf16", out_ptr="*bf16")
    const = dict(FORMAT=fmt, GROUP=0, HALF=0, HAS_BIAS=False, BLOCK_N=bn, BLOCK_K=bk, INTERPRETED=False, FLOAT_ZERO=False, LOOP_STAGES=stages, PDL=True, stride_sn=0, TILES=tiles)
    div = ["x_ptr", "w_ptr", "scale_ptr", "zero_ptr", "bias_ptr", "out_ptr", "N", "K", "stride_wn"]
elif which == "silu":
    fn = qg._gemv_silu_kernel
    sig = {n: "i32" for n in fn.arg_names}
    sig.update(x_ptr="*bf16", w_ptr=wt, scale_ptr="*fp32", bias_ptr="*bf16", out_ptr="*bf16")
    const = dict(FORMAT=fmt, HAS_BIAS=False, DT=2, BLOCK_N=bn, BLOCK_K=bk, INTERPRETED=False, LOOP_STAGES=stages, PDL=True, TILES=tiles)
    div = ["x_ptr", "w_ptr", "scale_ptr", "bias_ptr", "out_ptr", "I", "K", "stride_wn"]
else:
    fn = qg._gemv_rotary_kernel
    sig = {n: "i32" for n in fn.arg_names}
    sig.update(x_ptr="*bf16", w_ptr=wt, scale_ptr="*fp32", bias_ptr="*bf16", q_ptr="*bf16", pos_ptr="*i64", cos_ptr="*fp32", sin_ptr="*fp32",
               slot_ptr="*i64", kc_ptr="*bf16", vc_ptr="*bf16")
    const = dict(FORMAT=fmt, HAS_BIAS=False, DT=2, BLOCK_N=bn, BLOCK_K=bk, INTERPRETED=False, LOOP_STAGES=stages, PDL=True, HALF_D=64, CACHE_BLOCK_SIZE=64, TILES=tiles)
    div = ["x_ptr", "w_ptr", "scale_ptr", "bias_ptr", "q_ptr", "N", "K", "stride_wn", "kc_ptr", "vc_ptr", "skc_b", "skc_s", "svc_b", "Q_SIZE", "KV_SIZE"]; const.update(skc_d=1, svc_d=1)
sig.update({c: "constexpr" for c in const})
attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in div}
ck = triton.compile(ASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=2))
ptx = ck.asm["ptx"]
fn_ = f"/tmp/tk_{which}_{fmt}_{tiles}.ptx"; open(fn_, "w").write(ptx)
ptxas = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")
r = subprocess.run([ptxas, "-arch=sm_90a", "-v", fn_, "-o", "/dev/null"], capture_output=True, text=True)
regs = re.findall(r"Used (\d+) registers", r.stderr)
print(which, fmt, tiles, "regs", regs, "spill", re.findall(r"(\d+) bytes spill stores", r.stderr), "smem", ck.metadata.shared)
