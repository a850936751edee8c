"""Instructions per loop of the e4m3 decode kernel, compiled for sm_90 on a CPU (no GPU):
Llama-3.1-8B heads (32 q / 8 kv, D 128), 64-token blocks, tiles of 128 tokens. For each
loop (the whole tiles, then the masked tail): its SASS instruction count and global loads.

    PYTHONPATH=TREE/src:TREE python sass_decode_loops.py STAGES [transposed]

TREE: a checkout of the kernels (git archive COMMIT csrc_triton src); `transposed` needs
transposed_variant.diff applied. Output: sass_decode_loops.txt in this folder."""
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import csrc_triton._kernels as K

stages, transposed = int(sys.argv[1]), sys.argv[2:] == ["transposed"]
fn = K._decode_split_kernel
sig = {n: "i32" for n in fn.arg_names}
sig.update(q_ptr="*bf16", out_ptr="*bf16", k_cache_ptr="*fp8e4nv", v_cache_ptr="*fp8e4nv",
           part_o_ptr="*fp32", part_lse_ptr="*fp32", counters_ptr="*i32",
           block_tables_ptr="*i32", seq_lens_ptr="*i32", qk_scale="fp32")
const = dict(NUM_Q_HEADS=32, GQA=4, HEAD_DIM=128, BLOCK_SIZE=64, BLOCK_G=16, BLOCK_N=128,
             BLOCK_D=128, NUM_SPLITS=1, DOT_FP32=False, FUSED_REDUCE=False, PDL=False,
             stride_qd=1, stride_od=1, stride_kcd=1, stride_btn=1, stride_vcd=64, stride_vcs=1)
if transposed:
    const["TRANSPOSED"] = True
for c in const:
    sig[c] = "constexpr"
# The launch's specialization: pointers and strides divisible by 16 (stride_bts is not)
attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in fn.arg_names
         if n not in const and (n.endswith("_ptr") or n.startswith("stride_")) and n != "stride_bts"}
ck = triton.compile(ASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                    options=dict(num_warps=4, num_stages=stages))
with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
    f.write(ck.asm["cubin"])
nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/nvdisasm")
sass = subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True).stdout
labels, lines = {}, []
for line in sass.splitlines():
    m = re.match(r"\.(L_x_\d+):", line.strip())
    if m:
        labels[m.group(1)] = len(lines)
        continue
    m = re.match(r"\s+/\*[0-9a-f]{4}\*/\s+(.*?);", line)
    if m:
        lines.append(re.sub(r"^@!?U?P\w+\s+", "", m.group(1)))
out = [f"{os.environ.get('TREE', '?')} stages={stages} transposed={transposed} "
       f"wgmma={ck.asm['ptx'].count('wgmma.mma_async')} mma.sync={ck.asm['ptx'].count('mma.sync')}"]
for i, line in enumerate(lines):
    m = re.search(r"BRA\s+(?:`\()?\.?(L_x_\d+)", line)
    if m and m.group(1) in labels and labels[m.group(1)] < i:
        ops = Counter(x.split()[0] for x in lines[labels[m.group(1)]:i + 1])
        loads = {k: v for k, v in ops.items() if k.startswith(("LDG", "LDGSTS"))}
        out.append(f"  loop: {sum(ops.values())} instructions, global loads {loads}")
print("\n".join(out))
