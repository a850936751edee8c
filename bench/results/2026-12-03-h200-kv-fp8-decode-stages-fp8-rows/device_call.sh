set -u
export PYTHONPATH=$PWD/src:$PWD MINIVLLM_GIT_COMMIT=$(cat bench/.commit) HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
S=$(date +%s); R=$OUT/r3; mkdir -p $R; t(){ echo "$1 rc=$2 $(( $(date +%s)-S ))s" >> $R/times.log; }
left(){ echo $(( $1 - ($(date +%s)-S) )); }
timeout 70 python3 -m pytest -q --maxfail=5 -m gpu tests/test_gpu_quantization.py tests/test_fused_kernels.py -k "row_quantization or e4m3 or fp8_activations" > $R/gpu_tests.log 2>&1; t tests $?
timeout 30 python3 .ab/decode_ab.py new $R/decode_ab.jsonl 3 >> $R/decode_ab.log 2>&1; t dec_new3 $?
timeout 30 python3 .ab/decode_ab.py new $R/decode_ab.jsonl 2 >> $R/decode_ab.log 2>&1; t dec_new2 $?
PYTHONPATH=$PWD/.ab:$PWD/src:$PWD AB_FP8_DECODE_STAGES=3 timeout 80 python3 -m bench.kv_cache_fp8 --out $R/kv_cache_fp8_3_stages.json > $R/kv3.log 2>&1; t kv3 $?
L=$(left 290); timeout $L python3 -m bench.offline_ab --model llama-3.1-8b --workloads w1 --variant "rows_loop;PYTHONPATH=$PWD/.ab/oldrows:$PWD/src:$PWD;--quantization fp8" --variant "rows_whole;;--quantization fp8" --processes 1 --budget-s $((L-3)) --process-limit-s 70 --out $R/w1_fp8_rows_ab > $R/w1_fp8_rows_ab.log 2>&1; t ab $?
cat $R/times.log; tail -2 $R/gpu_tests.log; grep -h variant $R/decode_ab.log; grep -h "ms\|x" $R/kv3.log | tail -8; tail -5 $R/w1_fp8_rows_ab.log
tar czf $OUT/callB.tgz -C $OUT r3
