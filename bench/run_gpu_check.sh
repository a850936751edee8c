#!/usr/bin/env bash
# One device call: correctness checks, then benchmarks, results packed into $OUT.
# Each group runs in its own process under a time limit, so a crash or a slow peer in one
# group still leaves the others' results.
# Usage (on the GPU machine, from the repo root): bash bench/run_gpu_check.sh
set -u
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/minivllm-out}
RES=/tmp/minivllm-results
mkdir -p "$OUT" "$RES"
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv | tee "$RES/nvidia-smi.txt"
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
run() {  # run LIMIT_S SECTIONS [ENV...]
  local limit=$1 sections=$2; shift 2
  env "$@" timeout "$limit" python3 -m bench.gpu_check --sections "$sections" --out-dir "$RES" \
    >>"$RES/gpu_check.log" 2>&1
  echo "[$sections] exit $?" | tee -a "$RES/gpu_check.log"
}
# The kernels' own GPU tests first (compiled Triton, realistic shapes, graph replay).
timeout "${T_TESTS:-150}" python3 -m pytest -q -x -m gpu tests/test_triton_kernels.py \
  tests/test_fused_kernels.py >"$RES/gpu_tests.log" 2>&1
echo "[gpu tests] exit $?" | tee -a "$RES/gpu_check.log"; tail -3 "$RES/gpu_tests.log"
run "${T_PERF:-200}" "${S_PERF:-w2,sweep,w1}" MINIVLLM_COMPILE=0 GPU_CHECK_SKIP_COMPILE=1
run "${T_GRAPHS:-150}" "${S_GRAPHS:-graphs}"
run "${T_BF16:-80}" "${S_BF16:-bf16}"
run "${T_HF:-100}" "${S_HF:-hf}"
grep -E "^(W1|W2|HF|sweep|parity|graphs|bf16)|exit|FAILED" "$RES/gpu_check.log"
tar czf "$OUT/results.tgz" -C "$RES" .
