# run at 3e86231 with bench/diagnostics/decode_splits.py as committed in 1fb2fa9
set -u
export PYTHONPATH=$PWD/src:$PWD MINIVLLM_GIT_COMMIT=$(cat bench/.commit) HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
S=$(date +%s); R=$OUT/r; mkdir -p $R; t(){ echo "$1 rc=$2 $(( $(date +%s)-S ))s" >> $R/times.log; }
left(){ echo $(( $1 - ($(date +%s)-S) )); }
timeout 100 python3 -m bench.diagnostics.decode_splits --out $R/decode_splits.json > $R/decode_splits.log 2>&1; t splits $?
timeout 110 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_quantization.py tests/test_triton_kernels.py -k "split_k or graphs_match or nan_past" > $R/gpu_tests.log 2>&1; t tests $?
L=$(left 470); timeout $L python3 -m bench.offline_ab --model llama-3.1-8b --workloads w5 --variant "step16384;;--max-num-batched-tokens 16384" --variant default --processes 2 --budget-s $((L-3)) --process-limit-s 90 --out $R/w5_step_ab > $R/w5_step_ab.log 2>&1; t ab $?
cat $R/times.log; tail -3 $R/gpu_tests.log; cat $R/decode_splits.log | cut -c1-150; tail -8 $R/w5_step_ab.log
tar czf $OUT/out.tgz -C $OUT r
