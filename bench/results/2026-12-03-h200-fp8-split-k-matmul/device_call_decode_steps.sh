# .ab/sitecustomize.py: ab_hooks.py here; .ab/pick_fp8mm.py, .ab/merge_picks.py: the copies here
# .ab/picks2.json: fp32-every-128/picks.json
set -u
export PYTHONPATH=$PWD/src:$PWD MINIVLLM_GIT_COMMIT=$(cat bench/.commit) HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
S=$(date +%s); R=$OUT/r; mkdir -p $R; t(){ echo "$1 rc=$2 $(( $(date +%s)-S ))s" >> $R/times.log; }
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_quantization.py -m gpu -k "split_k" > $R/gpu_tests.log 2>&1; t tests $?
for i in 0 1; do
timeout 100 python3 -m bench.diagnostics.decode_steps --quantization fp8 --label cublas --out $R/decode_steps_fp8_cublas_p$i.json > $R/ds_cublas_p$i.log 2>&1; t cublas$i $?
PYTHONPATH=$PWD/.ab:$PWD/src:$PWD AB_FP8_MM_PICK=$PWD/.ab/picks2.json timeout 100 python3 -m bench.diagnostics.decode_steps --quantization fp8 --label split_k --out $R/decode_steps_fp8_split_k_p$i.json > $R/ds_split_p$i.log 2>&1; t split$i $?
done
cat $R/times.log; tail -3 $R/gpu_tests.log; tail -9 $R/ds_*.log
tar czf $OUT/out.tgz -C $OUT r
