set -u
export PYTHONPATH=$PWD/src:$PWD MINIVLLM_GIT_COMMIT=$(cat bench/.commit) HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
S=$(date +%s); R=$OUT/r; mkdir -p $R; t(){ echo "$1 rc=$2 $(( $(date +%s)-S ))s" >> $R/times.log; }
timeout 40 python3 -m bench.diagnostics.decode_splits --points 64x8192,32x8192,16x4000,1x8192,1x300 --splits 1 --out $R/decode_splits_plan.json > $R/decode_splits.log 2>&1; t splits $?
for q in fp8 none; do
  QF=""; [ $q != none ] && QF="--quantization $q"
  MINIVLLM_PDL=0 timeout 70 python3 -m bench.step_profile --model llama-3.1-8b --workload W2 --requests 1 --top 30 $QF --out $R/step_profile_llama8b_w2_${q}_no_pdl.json > $R/prof_$q.log 2>&1; t prof_$q $?
done
timeout 230 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_engine.py tests/test_gpu_quantization.py -k "graphs or fast_paths or fp8_kv_cache or preemption" > $R/gpu_engine_tests.log 2>&1; t tests $?
cat $R/times.log; tail -3 $R/gpu_engine_tests.log; cut -c1-130 $R/decode_splits.log | tail -8; tail -3 $R/prof_*.log
tar czf $OUT/out.tgz -C $OUT r
set -u
export PYTHONPATH=$PWD/src:$PWD MINIVLLM_GIT_COMMIT=$(cat bench/.commit) HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
S=$(date +%s); R=$OUT/r; mkdir -p $R; t(){ echo "$1 rc=$2 $(( $(date +%s)-S ))s" >> $R/times.log; }
left(){ echo $(( $1 - ($(date +%s)-S) )); }
timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_quantization.py -k "epilogues or linear_gemv_compiled or loop_stages" > $R/gpu_tests.log 2>&1; t tests $?
tail -3 $R/gpu_tests.log
if grep -q "failed\|error" $R/gpu_tests.log; then tail -40 $R/gpu_tests.log; fi
P="PYTHONPATH=$PWD/.ab:$PWD/src:$PWD AB_NO_EPILOGUES=1"
L=$(left 420); timeout $L python3 -m bench.offline_ab --model llama-3.1-8b --workloads w2 \
  --variant "fp8_epilogues;;--quantization fp8" --variant "fp8_plain;$P;--quantization fp8" \
  --variant "bf16_epilogues;;" --variant "bf16_plain;$P;" \
  --processes 2 --budget-s $((L-5)) --process-limit-s 80 --out $R/w2_epilogues_ab > $R/ab.log 2>&1; t ab $?
cat $R/times.log; tail -12 $R/ab.log
tar czf $OUT/out.tgz -C $OUT r
set -u
export PYTHONPATH=$PWD/src:$PWD MINIVLLM_GIT_COMMIT=$(cat bench/.commit) HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
S=$(date +%s); R=$OUT/r; mkdir -p $R; t(){ echo "$1 rc=$2 $(( $(date +%s)-S ))s" >> $R/times.log; }
timeout 60 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_quantization.py tests/test_fused_kernels.py -k "epilogues or rotary or silu" > $R/gpu_tests.log 2>&1; t tests $?
tail -3 $R/gpu_tests.log
if grep -q "failed\|error" $R/gpu_tests.log; then grep -n "Error\|^E " $R/gpu_tests.log | head -20; fi
for q in fp8 none; do
  QF=""; [ $q != none ] && QF="--quantization $q"
  MINIVLLM_PDL=0 timeout 70 python3 -m bench.step_profile --model llama-3.1-8b --workload W2 --requests 1 --top 30 $QF --out $R/step_profile_llama8b_w2_${q}_no_pdl_epilogues.json > $R/prof_$q.log 2>&1; t prof_$q $?
done
P="PYTHONPATH=$PWD/.ab:$PWD/src:$PWD AB_NO_EPILOGUES=1"
L=$(( 330 - ($(date +%s)-S) )); timeout $L python3 -m bench.offline_ab --model llama-3.1-8b --workloads w2 \
  --variant "fp8_epilogues;;--quantization fp8" --variant "fp8_plain;$P;--quantization fp8" \
  --variant "bf16_epilogues;;" --variant "bf16_plain;$P;" \
  --processes 1 --budget-s $((L-5)) --process-limit-s 80 --out $R/w2_epilogues_ab > $R/ab.log 2>&1; t ab $?
cat $R/times.log; tail -7 $R/ab.log
python3 - <<'P'
import json, os
R = os.environ["OUT"] + "/r"
for q in ("fp8", "none"):
    d = json.load(open(f"{R}/step_profile_llama8b_w2_{q}_no_pdl_epilogues.json"))
    print(q, d["wall_ms"], d["kernel_ms"])
    for r in d["top_kernels"][:9]: print("  %-40s %8.2f %6d %7.2f" % (r["kernel"][:40], r["ms"], r["calls"], r["us_per_call"]))
P
tar czf $OUT/out.tgz -C $OUT r
set -u
export PYTHONPATH=$PWD/src:$PWD MINIVLLM_GIT_COMMIT=$(cat bench/.commit) HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
S=$(date +%s); R=$OUT/r; mkdir -p $R
P="PYTHONPATH=$PWD/.ab:$PWD/src:$PWD"
timeout 200 python3 -m bench.offline_ab --model llama-3.1-8b --workloads w2 \
  --variant "bf16_plain;$P AB_NO_EPILOGUES=1;" --variant "bf16_rotary_only;$P AB_W16_EPILOGUES=rotary;" \
  --variant "bf16_both;;" \
  --processes 2 --budget-s 190 --process-limit-s 60 --out $R/w2_bf16_epilogues_ab > $R/ab.log 2>&1
tail -12 $R/ab.log
tar czf $OUT/out.tgz -C $OUT r
