"""Compile csrc_triton/_kernels.py's _decode_split_kernel (under ROOT) for sm_90a on the CPU
(bf16 cache, head_dim 128, GQA 4, blocks of 64; the shipped decode config) and print what
ptxas -v says. RAGGED=1 compiles the mixed-step variant (a kernel without it ignores it)."""
import os, subprocess, sys, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
sys.path.insert(0, sys.argv[1])
from csrc_triton import _kernels as K
ragged, fused = int(sys.argv[2]), int(sys.argv[3])
fn = K._decode_split_kernel
sig = {n: "i32" for n in fn.arg_names}
sig.update(q_ptr="*bf16", k_cache_ptr="*bf16", v_cache_ptr="*bf16", out_ptr="*bf16",
           part_o_ptr="*fp32", part_lse_ptr="*fp32", counters_ptr="*i32",
           block_tables_ptr="*i32", seq_lens_ptr="*i32", qk_scale="fp32")
if "query_start_loc_ptr" in fn.arg_names:
    sig["query_start_loc_ptr"] = "*i32"
const = dict(NUM_Q_HEADS=32, GQA=4, HEAD_DIM=128, BLOCK_SIZE=64, BLOCK_G=16, BLOCK_N=64,
             BLOCK_D=128, NUM_SPLITS=2, DOT_FP32=False, FUSED_REDUCE=bool(fused), PDL=True)
if "RAGGED" in fn.arg_names:
    const["RAGGED"] = bool(ragged)
for c in ("stride_qd", "stride_od", "stride_kcd", "stride_vcd"):
    sig[c] = "constexpr"; const[c] = 1
sig.update({c: "constexpr" for c in const})
ck = triton.compile(ASTSource(fn, sig, const), target=GPUTarget("cuda", 90, 32),
                    options=dict(num_warps=4, num_stages=3))
with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
    f.write(ck.asm["ptx"])
ptxas = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")
r = subprocess.run([ptxas, "-arch=sm_90a", "-v", f.name, "-o", "/dev/null"], capture_output=True, text=True)
import hashlib; print(hashlib.sha1(ck.asm["ptx"].encode()).hexdigest()[:12], f"ragged={ragged} fused={fused}", [l.split("info    :")[-1].strip() for l in r.stderr.splitlines() if "registers" in l or "spill" in l])
