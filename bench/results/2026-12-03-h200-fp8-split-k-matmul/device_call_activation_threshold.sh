# .ab/sitecustomize.py: ab_hooks.py here; .ab/pick_fp8mm.py, .ab/merge_picks.py: the copies here
set -u
export PYTHONPATH=$PWD/src:$PWD MINIVLLM_GIT_COMMIT=$(cat bench/.commit) HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
S=$(date +%s); R=$OUT/r; mkdir -p $R; t(){ echo "$1 rc=$2 $(( $(date +%s)-S ))s" >> $R/times.log; }
timeout 130 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_quantization.py -m gpu -k "split_k or graphs_match or kernels_match or fp8" > $R/gpu_tests.log 2>&1; t tests $?
timeout 80 python3 -m bench.diagnostics.decode_steps --points 1x1024,2x1024,4x1024,8x1024,16x1024,32x1024,64x1024,128x1024 --quantization fp8 --label shipped --out $R/decode_steps_shipped.json > $R/ds_a.log 2>&1; t shipped $?
PYTHONPATH=$PWD/.ab:$PWD/src:$PWD AB_FP8_MIN_TOKENS=1 timeout 70 python3 -m bench.diagnostics.decode_steps --points 2x1024,4x1024,8x1024 --quantization fp8 --label w8a8_from_2_rows --out $R/decode_steps_from_2_rows.json > $R/ds_b.log 2>&1; t from2 $?
cat $R/times.log; tail -3 $R/gpu_tests.log; grep batch $R/ds_a.log $R/ds_b.log
tar czf $OUT/out.tgz -C $OUT r
