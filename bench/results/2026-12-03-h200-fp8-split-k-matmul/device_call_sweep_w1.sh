# .ab/sitecustomize.py: ab_hooks.py here; .ab/pick_fp8mm.py, .ab/merge_picks.py: the copies here
set -u
export PYTHONPATH=$PWD/src:$PWD MINIVLLM_GIT_COMMIT=$(cat bench/.commit) HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
S=$(date +%s); R=$OUT/r; mkdir -p $R; t(){ echo "$1 rc=$2 $(( $(date +%s)-S ))s" >> $R/times.log; }
left(){ echo $(( $1 - ($(date +%s)-S) )); }
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader > $R/gpu.txt
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_quantization.py -m gpu -k "split_k or kernels_match" > $R/gpu_tests.log 2>&1; t tests $?
timeout 230 python3 -m bench.diagnostics.fp8_mm_sweep --out $R/fp8_mm_sweep.json > $R/fp8_mm_sweep.log 2>&1; t sweep $?
python3 .ab/pick_fp8mm.py $R/fp8_mm_sweep.json $R/picks.json > $R/picks.log 2>&1
AB="PYTHONPATH=$PWD/.ab:$PWD/src:$PWD"
L=$(left 585); timeout $L python3 -m bench.offline_ab --model llama-3.1-8b --workloads w1 --variant "cublas;;--quantization fp8" --variant "picked;$AB AB_FP8_MM_PICK=$R/picks.json;--quantization fp8" --processes 2 --budget-s $((L-5)) --process-limit-s 100 --out $R/w1_fp8_ab > $R/w1_fp8_ab.log 2>&1; t ab_w1 $?
cat $R/picks.log; cat $R/times.log; tail -5 $R/gpu_tests.log
tail -12 $R/w1_fp8_ab.log
tar czf $OUT/sweep.tgz -C $OUT r
