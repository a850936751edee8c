set -u
export PYTHONPATH=$PWD/src:$PWD MINIVLLM_GIT_COMMIT=$(cat bench/.commit) HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
S=$(date +%s); R=$OUT/r; mkdir -p $R; t(){ echo "$1 rc=$2 $(( $(date +%s)-S ))s" >> $R/times.log; }
left(){ echo $(( $1 - ($(date +%s)-S) )); }
timeout 90 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_quantization.py tests/test_triton_kernels.py -k "epilogues_compiled or launched_early" > $R/gpu_tests.log 2>&1; t tests $?
tail -3 $R/gpu_tests.log
if grep -q "failed\|error" $R/gpu_tests.log; then grep -n "Error\|^E \|FAILED" $R/gpu_tests.log | head -20; fi
A="PYTHONPATH=$PWD/.ab:$PWD/src:$PWD"
L=$(left 330); timeout $L python3 -m bench.offline_ab --model llama-3.1-8b --workloads w2 \
  --variant "fp8_norm_epilogue;;--quantization fp8" --variant "fp8_norm_kernel;$A AB_NO_NORM_EPILOGUE=1;--quantization fp8" \
  --variant "bf16_norm_kernel;;" --variant "bf16_norm_epilogue;$A AB_W16_NORM_EPILOGUE=1;" \
  --processes 2 --budget-s $((L-5)) --process-limit-s 50 --out $R/w2_norm_ab > $R/ab.log 2>&1; t ab $?
tail -7 $R/ab.log
L=$(left 440); timeout $L python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_quantization.py tests/test_gpu_engine.py -k "graphs or fp8_kv_cache" > $R/gpu_engine_tests.log 2>&1; t engine_tests $?
tail -3 $R/gpu_engine_tests.log
cat $R/times.log
tar czf $OUT/out.tgz -C $OUT r
