# .ab/sitecustomize.py: ab_hooks.py here; .ab/pick_fp8mm.py, .ab/merge_picks.py: the copies here
# .ab/picks2.json: fp32-every-128/picks.json
set -u
export PYTHONPATH=$PWD/src:$PWD MINIVLLM_GIT_COMMIT=$(cat bench/.commit) HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
S=$(date +%s); R=$OUT/r; mkdir -p $R; t(){ echo "$1 rc=$2 $(( $(date +%s)-S ))s" >> $R/times.log; }
timeout 130 python3 -m bench.diagnostics.fp8_mm_sweep --rows 8,16,24,32 --out $R/fp8_mm_sweep_small.json > $R/fp8_mm_sweep_small.log 2>&1; t sweep $?
python3 .ab/pick_fp8mm.py $R/fp8_mm_sweep_small.json $R/picks_small.json > $R/picks_small.log 2>&1
python3 .ab/merge_picks.py .ab/picks2.json $R/picks_small.json $R/picks_all.json > /dev/null
P="8x1024,16x1024,24x1024,32x1024,40x1024,48x1024"
timeout 90 python3 -m bench.diagnostics.decode_steps --points $P --quantization fp8 --label shipped --out $R/decode_steps_small_shipped.json > $R/ds_a.log 2>&1; t shipped $?
PYTHONPATH=$PWD/.ab:$PWD/src:$PWD AB_FP8_MM_PICK=$R/picks_all.json AB_FP8_MIN_TOKENS=8 timeout 90 python3 -m bench.diagnostics.decode_steps --points $P --quantization fp8 --label split_k_from_9_rows --out $R/decode_steps_small_split_k.json > $R/ds_b.log 2>&1; t split $?
cat $R/picks_small.log $R/times.log; grep batch $R/ds_a.log $R/ds_b.log
tar czf $OUT/out.tgz -C $OUT r
