"""The fp8 GEMV's loop compiled for sm_90 on a CPU (no GPU): Llama-3.1-8B's o/down config
(8 rows x 1,024 inputs, 4 warps), LOOP_STAGES given; its SASS instructions and loads per
loop, and shared memory. PYTHONPATH=[TRITON_SITE:]TREE/src:TREE python sass_gemv_loop.py STAGES"""
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import csrc_triton.quant_gemm as Q

fn = Q._wq_gemv_kernel
stages = int(sys.argv[1])
sig = {n: "i32" for n in fn.arg_names}
sig.update(x_ptr="*bf16", w_ptr="*u8", scale_ptr="*fp32", zero_ptr="*fp32", bias_ptr="*fp32",
           out_ptr="*bf16")
const = dict(FORMAT=1, GROUP=0, HALF=0, HAS_BIAS=False, BLOCK_N=8, BLOCK_K=1024,
             INTERPRETED=False, FLOAT_ZERO=False, PDL=True, stride_sn=0, LOOP_STAGES=stages)
sig.update({c: "constexpr" for c in const})
attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in fn.arg_names
         if n not in const and (n.endswith("_ptr") or n.startswith("stride_") or n == "K")}
ck = triton.compile(ASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                    options=dict(num_warps=4, num_stages=2))
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
out = [f"triton {triton.__version__} LOOP_STAGES={stages} shared={ck.metadata.shared}"]
for i, line in enumerate(lines):
    m = re.search(r"BRA\s+(?:`\()?\.?(L_x_\d+)", line)
    if m and m.group(1) in labels and labels[m.group(1)] < i:
        ops = Counter(x.split()[0] for x in lines[labels[m.group(1)]:i + 1])
        loads = {k: v for k, v in ops.items() if k.startswith(("LDG", "LDS"))}
        out.append(f"  loop: {sum(ops.values())} instructions, loads {loads}")
print("\n".join(out))
