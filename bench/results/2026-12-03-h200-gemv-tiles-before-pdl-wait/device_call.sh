set -u
export PYTHONPATH=$PWD/src:$PWD MINIVLLM_GIT_COMMIT=$(cat bench/.commit) HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
S=$(date +%s); R=$OUT/r; mkdir -p $R; t(){ echo "$1 rc=$2 $(( $(date +%s)-S ))s" >> $R/times.log; }
left(){ echo $(( $1 - ($(date +%s)-S) )); }
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_quantization.py -k "epilogues or loop_stages or graphs_match or fp8_kv_cache" > $R/gpu_tests.log 2>&1; t tests $?
tail -3 $R/gpu_tests.log
if grep -q "failed\|error" $R/gpu_tests.log; then grep -n "Error\|^E \|FAILED" $R/gpu_tests.log | head -20; fi
A="PYTHONPATH=$PWD/.ab:$PWD/src:$PWD AB_GEMV_TILES"
L=$(left 560); timeout $L python3 -m bench.offline_ab --model llama-3.1-8b --workloads w2 \
  --variant "fp8_tiles1;;--quantization fp8" --variant "fp8_tiles2;$A=fp8:*=2;--quantization fp8" \
  --variant "fp8_tiles4;$A=fp8:*=4;--quantization fp8" --variant "fp8_o4;$A=fp8:4096x4096=4;--quantization fp8" \
  --variant "bf16_tiles1;;" --variant "bf16_tiles2;$A=w16:*=2;" \
  --processes 2 --budget-s $((L-5)) --process-limit-s 60 --out $R/w2_tiles_ab > $R/ab.log 2>&1; t ab $?
cat $R/times.log; tail -9 $R/ab.log
tar czf $OUT/out.tgz -C $OUT r
