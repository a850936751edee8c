set -u
export PYTHONPATH=$PWD/src:$PWD MINIVLLM_GIT_COMMIT=$(cat bench/.commit) HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
S=$(date +%s); R=$OUT/r2; mkdir -p $R; t(){ echo "$1 rc=$2 $(( $(date +%s)-S ))s" >> $R/times.log; }
left(){ echo $(( $1 - ($(date +%s)-S) )); }
timeout 170 python3 -m pytest -q --maxfail=5 -m gpu tests/test_gpu_quantization.py tests/test_fused_kernels.py tests/test_triton_kernels.py -k "loop_stages or e4m3 or nan_past or routing or fp8 or graphs_match or early" > $R/gpu_tests.log 2>&1; t tests $?
timeout 90 python3 -m bench.vs_vllm offline --engine minivllm --model llama-3.1-8b --workloads w1,w2 --quantization fp8 --out $R/fp8_w1_w2 > $R/fp8_w1_w2.log 2>&1; t fp8 $?
for i in 1 2; do
  timeout 35 python3 .ab/decode_ab.py new $R/decode_ab.jsonl >> $R/decode_ab.log 2>&1; t dec_new $?
  PYTHONPATH=$PWD/.ab/old:$PWD/src:$PWD timeout 35 python3 .ab/decode_ab.py old $R/decode_ab.jsonl >> $R/decode_ab.log 2>&1; t dec_old $?
done
L=$(left 440); [ $L -gt 60 ] && { timeout $((L<100?L:100)) python3 -m bench.step_profile --model llama-3.1-8b --workload W1 --requests 128 --quantization fp8 --out $R/step_profile_llama8b_w1_fp8.json > $R/prof_fp8.log 2>&1; t prof_fp8 $?; }
cat $R/times.log; tail -3 $R/gpu_tests.log; grep -h "rep " $R/fp8_w1_w2.log; grep -h variant $R/decode_ab.log
tar czf $OUT/callA2.tgz -C $OUT r2
