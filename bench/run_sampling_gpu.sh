#!/usr/bin/env bash
# The sampler on the GPU machine, in one device call: its GPU tests, its microbenchmark
# (bench/sampler_bench.py) and minivllm's offline workloads under every sampling setting
# (bench/vs_vllm.py --sampling), each part in its own process under a time limit; the
# results land in $OUT. The head-to-head with vLLM is bench/run_vs_vllm.sh (VS_SAMPLING).
#
#   bash bench/run_sampling_gpu.sh [PART ...]   # from the repo root on the GPU machine
# Parts: tests, micro, settings:MODEL:WORKLOADS:SETTINGS (e.g.
# settings:qwen2.5-0.5b-instruct:w1:all, settings:llama-3.1-8b:w1,w2:greedy,sampled);
# ROUNDS=N runs the settings N times over, in turn.
set -u
cd "$(dirname "$0")/.." || exit 1
START=$(date +%s)
OUT=${OUT:-/tmp/minivllm-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src:$PWD" PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
export MINIVLLM_GIT_COMMIT=${MINIVLLM_GIT_COMMIT:-$(cat bench/.commit 2>/dev/null || echo unknown)}
ALL=greedy,sampled,temperature,top_p,top_k,min_p,repetition,presence,frequency
say() { echo "[run_sampling_gpu +$(( $(date +%s) - START ))s] $*"; }
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(tests micro)
for part in "${parts[@]}"; do
  case $part in
    tests) timeout "${T_TESTS:-200}" python3 -m pytest -q -rs --tb=short -p no:cacheprovider \
             tests/test_gpu_sampler.py > "$OUT/gpu_sampler_tests.log" 2>&1
           say "tests: exit $?"; tail -3 "$OUT/gpu_sampler_tests.log" ;;
    micro) timeout "${T_MICRO:-120}" python3 -m bench.sampler_bench --rows ${MICRO_ROWS:-1 256} \
             --out "$OUT/sampler_bench.json" ${MICRO_ARGS:-} > "$OUT/sampler_bench.log" 2>&1
           say "micro: exit $?"; cat "$OUT/sampler_bench.log" ;;
    settings:*)
      IFS=: read -r _ model wl sampling <<< "$part"
      [ "$sampling" = all ] && sampling=$ALL
      timeout "${T_SETTINGS:-260}" python3 -m bench.vs_vllm offline --engine minivllm \
        --model "$model" --workloads "$wl" --sampling "$sampling" --rounds "${ROUNDS:-1}" \
        --out "$OUT/$model" \
        --work /tmp/minivllm-sampling-work > "$OUT/settings_$model.log" 2>&1
      say "settings $model: exit $?"; grep -E "rep [0-9]:" "$OUT/settings_$model.log" ;;
    *) say "unknown part $part" ;;
  esac
done
