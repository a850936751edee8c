# SWAP_AB at 8 / 16 rows: GPU tests, the sweep (shipped tiles and swapped), picks, the decode sweep A/B (.ab/sitecustomize.py is ab_hooks.py here).
set -u
export PYTHONPATH=$PWD/src:$PWD MINIVLLM_GIT_COMMIT=$(cat bench/.commit) HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
S=$(date +%s); R=$OUT/r; mkdir -p $R; t(){ echo "$1 rc=$2 $(( $(date +%s)-S ))s" >> $R/times.log; }
left(){ echo $(( $1 - ($(date +%s)-S) )); }
timeout 90 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_quantization.py -k "split_k_matmul_compiled" > $R/gpu_tests.log 2>&1; t tests $?
tail -3 $R/gpu_tests.log
timeout 240 python3 -m bench.diagnostics.fp8_mm_sweep --rows 8,16 --swapped also --out $R/fp8_mm_sweep_8_16_swapped.json > $R/sweep.log 2>&1; t sweep $?
tail -8 $R/sweep.log
python3 bench/results/2026-12-03-h200-fp8-split-k-matmul/pick_fp8mm.py $R/fp8_mm_sweep_8_16_swapped.json $R/picks.json > $R/picks.log 2>&1; cat $R/picks.log
A="PYTHONPATH=$PWD/.ab:$PWD/src:$PWD AB_FP8_MM_PICK=$R/picks.json AB_FP8_MM_PICK_FALLBACK=1"
L=$(left 560); timeout $L python3 -m bench.offline_ab --model llama-3.1-8b --workloads sweep \
  --variant "shipped;;--quantization fp8" --variant "picked;$A;--quantization fp8" \
  --processes 1 --budget-s $((L-5)) --process-limit-s 110 --out $R/sweep_ab > $R/ab.log 2>&1; t ab $?
tail -6 $R/ab.log; cat $R/times.log
tar czf $OUT/out.tgz -C $OUT r
