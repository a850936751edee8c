set -u
export PYTHONPATH=$PWD/src:$PWD MINIVLLM_GIT_COMMIT=$(cat bench/.commit) HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
( mkdir -p /tmp/vb && cp .vllm/a0 .vllm/a1 /tmp/vb/ && echo staged > $OUT/staged.txt ) &
S=$(date +%s); t(){ echo "$1 rc=$2 $(( $(date +%s)-S ))s" >> $OUT/times.log; }
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader > $OUT/gpu.txt
timeout 160 python3 -m pytest -q --maxfail=5 -m gpu tests/test_triton_kernels.py tests/test_gpu_quantization.py > $OUT/gpu_tests.log 2>&1; t tests $?
timeout 110 python3 -m bench.vs_vllm offline --engine minivllm --model llama-3.1-8b --workloads w1,w6 --kv-cache-dtype fp8 --out $OUT/kvfp8 > $OUT/kvfp8.log 2>&1; t kvfp8 $?
timeout 105 python3 -m bench.vs_vllm offline --engine minivllm --model llama-3.1-8b --workloads w1,w6 --out $OUT/kvauto > $OUT/kvauto.log 2>&1; t kvauto $?
timeout 75 python3 .ab/decode_config_e2e.py 256/4/2 $OUT/kvfp8_256 w1 > $OUT/kvfp8_256.log 2>&1; t kvfp8_256 $?
timeout 65 python3 -m bench.kv_cache_fp8 --out $OUT/kv_cache_fp8.json > $OUT/kv_cache_fp8.log 2>&1; t kvbench $?
timeout 55 python3 -m bench.diagnostics.int4_mma_sweep --rows 128,256,512 --out $OUT/int4_split_sweep.json > $OUT/int4_sweep.log 2>&1; t sweep $?
wait
grep -h "rep [0-9]\|passed\|failed\|Error" $OUT/*.log | grep -v "^ " | tail -30
cat $OUT/times.log
