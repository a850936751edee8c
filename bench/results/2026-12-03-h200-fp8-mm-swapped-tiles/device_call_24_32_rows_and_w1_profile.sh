# SWAP_AB routed at <= 16 rows: GPU tests; sweep at 24 / 32 rows (swapped with 32-row padding);
# a W1 fp8 profile without PDL (so kernel times are not inflated by grid-dependency waits).
set -u
export PYTHONPATH=$PWD/src:$PWD MINIVLLM_GIT_COMMIT=$(cat bench/.commit) HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
S=$(date +%s); R=$OUT/r; mkdir -p $R; t(){ echo "$1 rc=$2 $(( $(date +%s)-S ))s" >> $R/times.log; }
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_quantization.py -k "split_k_matmul_compiled or graphs_match_eager_with_quantization or fp8_kv_cache_through" > $R/gpu_tests.log 2>&1; t tests $?
tail -3 $R/gpu_tests.log
timeout 200 python3 -m bench.diagnostics.fp8_mm_sweep --rows 24,32 --swapped also --out $R/fp8_mm_sweep_24_32_swapped.json > $R/sweep.log 2>&1; t sweep $?
tail -4 $R/sweep.log
python3 bench/results/2026-12-03-h200-fp8-split-k-matmul/pick_fp8mm.py $R/fp8_mm_sweep_24_32_swapped.json $R/picks_24_32.json > $R/picks.log 2>&1; cat $R/picks.log
MINIVLLM_PDL=0 timeout 180 python3 -m bench.step_profile --model llama-3.1-8b --workload W1 --requests 128 --quantization fp8 --out $R/step_profile_w1_fp8_no_pdl.json > $R/profile.log 2>&1; t profile $?
tail -3 $R/profile.log; cat $R/times.log
tar czf $OUT/out.tgz -C $OUT r
