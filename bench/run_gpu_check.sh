#!/usr/bin/env bash
# One device call: correctness checks, then benchmarks, results packed into $OUT.
# Usage (on the GPU machine, from the repo root): bash bench/run_gpu_check.sh SECTIONS [KERNELS]
set -u
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/minivllm-out}
RES=/tmp/minivllm-results
mkdir -p "$OUT" "$RES"
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv | tee "$RES/nvidia-smi.txt"
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
python3 -m bench.gpu_check --sections "${1:-parity,graphs,bf16,w2,sweep,w1}" --out-dir "$RES" 2>&1 | tee "$RES/gpu_check.log"
if [ "${2:-}" = "kernels" ]; then
  timeout 200 python3 bench/kernel_check.py --out "$RES/kernel_check.json" 2>&1 | tail -60 | tee "$RES/kernel_check.log"
fi
tar czf "$OUT/results.tgz" -C "$RES" .
