# second call (75385c6); the first (168a6aa) ran the same with the A/B's variants fp8_norm_in_gemv / fp8_old / fp8_residual_only, process limit 75 s, and the tests killed at 170 s
set -u
export PYTHONPATH=$PWD/src:$PWD MINIVLLM_GIT_COMMIT=$(cat bench/.commit) HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
S=$(date +%s); R=$OUT/r; mkdir -p $R; t(){ echo "$1 rc=$2 $(( $(date +%s)-S ))s" >> $R/times.log; }
left(){ echo $(( $1 - ($(date +%s)-S) )); }
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv > $R/gpu.txt 2>&1
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_quantization.py tests/test_triton_kernels.py -k "next_gemv or launched_early or graphs_match_eager or epilogues_compiled or decode_cuda_graph or (fused_reduce and 1-300 and 128)" > $R/gpu_tests.log 2>&1; t tests $?
tail -3 $R/gpu_tests.log; grep -n "^E \|FAILED" $R/gpu_tests.log | head -20
A="PYTHONPATH=$PWD/.ab:$PWD/src:$PWD"
L=$(left 570); timeout $L python3 -m bench.offline_ab --model llama-3.1-8b --workloads w2 \
  --variant "fp8_prenorm;;--quantization fp8" --variant "fp8_old;$A AB_OLD=1;--quantization fp8" \
  --variant "fp8_residual_only;$A AB_RESIDUAL_ONLY=1;--quantization fp8" \
  --variant "bf16;;" --variant "bf16_w16_epilogues;$A AB_W16=1;" \
  --processes 2 --budget-s $((L-5)) --process-limit-s 60 --out $R/ab > $R/ab.log 2>&1; t ab $?
tail -8 $R/ab.log; cat $R/times.log
tar czf $OUT/out.tgz -C $OUT r
# the GPU tests at 93c8c03 (the tree with the variants reverted), another call
set -u
export PYTHONPATH=$PWD/src:$PWD MINIVLLM_GIT_COMMIT=$(cat bench/.commit) HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
S=$(date +%s); R=$OUT/r; mkdir -p $R; t(){ echo "$1 rc=$2 $(( $(date +%s)-S ))s" >> $R/times.log; }
timeout 300 python3 -m pytest -v -p no:cacheprovider -m gpu --durations=12 tests/test_triton_kernels.py -k "(gpu and (decode or prefill)) or launched_early" > $R/gpu_kernel_tests.log 2>&1; t kernel_tests $?
timeout 200 python3 -m pytest -v -p no:cacheprovider -m gpu --durations=5 tests/test_gpu_quantization.py -k "graphs_match_eager or epilogues_compiled" > $R/gpu_quant_tests.log 2>&1; t quant_tests $?
cat $R/times.log; grep -c PASSED $R/gpu_*tests.log; grep -h "FAILED\|ERROR\|passed\|failed" $R/gpu_*tests.log | tail -8
tar czf $OUT/out.tgz -C $OUT r
# the 128-row prefill tiles' GPU test at 53ef01f, a third call
set -u
export PYTHONPATH=$PWD/src:$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
S=$(date +%s); R=$OUT/r; mkdir -p $R
timeout 200 python3 -m pytest -v -p no:cacheprovider -m gpu --durations=5 tests/test_triton_kernels.py -k "groups_of_4 or descriptor_tiles" > $R/gpu_prefill_128_rows_tests.log 2>&1; echo "rc=$? $(( $(date +%s)-S ))s" >> $R/gpu_prefill_128_rows_tests.log
tail -12 $R/gpu_prefill_128_rows_tests.log
