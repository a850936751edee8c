# (1) sums every 256 inputs (PROMOTE_EVERY=256) at 64-256 rows, unswapped, with their error;
# (2) W1 fp8 A/B: shipped against the sweep's best per shape at 65-256 rows.
set -u
export PYTHONPATH=$PWD/src:$PWD MINIVLLM_GIT_COMMIT=$(cat bench/.commit) HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
S=$(date +%s); R=$OUT/r; mkdir -p $R; t(){ echo "$1 rc=$2 $(( $(date +%s)-S ))s" >> $R/times.log; }
left(){ echo $(( $1 - ($(date +%s)-S) )); }
timeout 250 python3 -m bench.diagnostics.fp8_mm_sweep --rows 64,128,192,256 --swapped none --promote-every 256 --out $R/fp8_mm_sweep_promote_256.json > $R/sweep.log 2>&1; t sweep $?
tail -16 $R/sweep.log
python3 .ab/pick_fp8mm.py $R/fp8_mm_sweep_promote_256.json $R/picks.json > $R/picks.log 2>&1; cat $R/picks.log
python3 - $R/fp8_mm_sweep_promote_256.json > $R/promote_best.log <<'P'
import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
best = {}
for r in rows:
    if r.get("kernel") == "triton" and "us" in r:
        k = (r["shape"], r["M"], r["config"][7] if len(r["config"]) > 7 else 128)
        if k not in best or r["us"] < best[k][0]:
            best[k] = (r["us"], r["rel_err"], r["config"])
base = {(r["shape"], r["M"]): (r["us"], r["rel_err"]) for r in rows if r.get("kernel") == "scaled_mm"}
for k in sorted(best):
    print(k, "cuBLAS", base[k[:2]], "best", best[k])
P
cat $R/promote_best.log
A="PYTHONPATH=$PWD/.ab:$PWD/src:$PWD AB_FP8_MM_PICK=$R/picks.json AB_FP8_MM_PICK_MIN_M=65 AB_FP8_MM_PICK_FALLBACK=1"
L=$(left 585); timeout $L python3 -m bench.offline_ab --model llama-3.1-8b --workloads w1 \
  --variant "shipped;;--quantization fp8" --variant "picked;$A;--quantization fp8" \
  --processes 2 --budget-s $((L-5)) --process-limit-s 80 --out $R/w1_ab > $R/ab.log 2>&1; t ab $?
tail -8 $R/ab.log; cat $R/times.log
tar czf $OUT/out.tgz -C $OUT r
