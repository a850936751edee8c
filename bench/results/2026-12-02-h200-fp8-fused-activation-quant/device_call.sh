set -u
export PYTHONPATH=$PWD/src:$PWD MINIVLLM_GIT_COMMIT=$(cat bench/.commit) HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
( mkdir -p /tmp/vb && cp .vllm/a0 .vllm/a1 /tmp/vb/ && echo staged > /tmp/staged.txt ) &
W=/tmp/w; mkdir -p $W
S=$(date +%s); t(){ echo "$1 rc=$2 $(( $(date +%s)-S ))s" >> $W/times.log; }
pk(){ tar czf $OUT/call2.tgz -C $W . ; }
timeout 150 python3 -m pytest -q --maxfail=5 -m gpu tests/test_fused_kernels.py tests/test_gpu_quantization.py > $W/gpu_tests.log 2>&1; t tests $?
timeout 60 python3 -m pytest -q --maxfail=5 -m gpu tests/test_triton_kernels.py -k "nan or split" > $W/gpu_tests_attention.log 2>&1; t tests2 $?
pk
Q="offline --engine minivllm --model llama-3.1-8b --workloads w1,w2,w6 --quantization fp8"
timeout 110 python3 -m bench.vs_vllm $Q --out $W/fused > $W/fused.log 2>&1; t fused $?
pk
timeout 110 python3 .ab/nofuse.py $Q --out $W/unfused > $W/unfused.log 2>&1; t unfused $?
pk
timeout 60 python3 -m bench.kv_cache_fp8 --out $W/kv_cache_fp8.json > $W/kv_cache_fp8.log 2>&1; t kvbench $?
wait; cat /tmp/staged.txt >> $W/times.log
pk
grep -h "rep [0-9]\|passed\|failed\|Error" $W/*.log | grep -v "^ " | tail -30
grep -A8 "^kv_cache_dtype" $W/kv_cache_fp8.log
cat $W/times.log
