# .ab/oldsplit/csrc_triton: csrc_triton at 1fb2fa9 (the split rule before this change)
set -u
export PYTHONPATH=$PWD/src:$PWD MINIVLLM_GIT_COMMIT=$(cat bench/.commit) HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
S=$(date +%s); R=$OUT/r; mkdir -p $R; t(){ echo "$1 rc=$2 $(( $(date +%s)-S ))s" >> $R/times.log; }
left(){ echo $(( $1 - ($(date +%s)-S) )); }
timeout 50 python3 -m bench.diagnostics.decode_splits --points 64x8192,32x8192,64x4096,64x1000,16x4000,128x2048,8x8192,1x8192,1x300 --splits 1 --out $R/decode_splits_plan.json > $R/decode_splits.log 2>&1; t splits $?
timeout 90 python3 -m bench.kv_cache_fp8 --out $R/kv_cache_fp8.json > $R/kv.log 2>&1; t kv $?
L=$(left 260); timeout $L python3 -m bench.offline_ab --model llama-3.1-8b --workloads w1 --variant "old_splits;PYTHONPATH=$PWD/.ab/oldsplit:$PWD/src:$PWD;--kv-cache-dtype fp8" --variant "wave_splits;;--kv-cache-dtype fp8" --processes 1 --budget-s $((L-3)) --process-limit-s 85 --out $R/w1_kvfp8_ab > $R/w1_ab.log 2>&1; t ab $?
L=$(left 330); timeout $L python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_triton_kernels.py -k "decode or nan_past" > $R/gpu_tests.log 2>&1; t tests $?
cat $R/times.log; tail -3 $R/gpu_tests.log; cut -c1-130 $R/decode_splits.log; grep -h "ms_per_step\|vs_auto" $R/kv.log | tail -8; tail -5 $R/w1_ab.log
tar czf $OUT/out.tgz -C $OUT r
