# GPU tests of the e4m3 SiLU out and the fp8 paths; W1 fp8 A/B: SiLU x up writing e4m3 vs before.
set -u
export PYTHONPATH=$PWD/src:$PWD MINIVLLM_GIT_COMMIT=$(cat bench/.commit) HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
S=$(date +%s); R=$OUT/r; mkdir -p $R; t(){ echo "$1 rc=$2 $(( $(date +%s)-S ))s" >> $R/times.log; }
left(){ echo $(( $1 - ($(date +%s)-S) )); }
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_fused_kernels.py tests/test_gpu_quantization.py -k "e4m3_outputs or silu or split_k_matmul_compiled or graphs_match_eager_with_quantization or fp8_kv_cache_through" > $R/gpu_tests.log 2>&1; t tests $?
tail -3 $R/gpu_tests.log
A="PYTHONPATH=$PWD/.ab:$PWD/src:$PWD AB_NO_SILU_FP8=1"
L=$(left 580); timeout $L python3 -m bench.offline_ab --model llama-3.1-8b --workloads w1 \
  --variant "silu-e4m3;;--quantization fp8" --variant "before;$A;--quantization fp8" \
  --processes 2 --budget-s $((L-5)) --process-limit-s 110 --out $R/w1_ab > $R/ab.log 2>&1; t ab $?
tail -8 $R/ab.log; cat $R/times.log
tar czf $OUT/out.tgz -C $OUT r
