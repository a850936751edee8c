set -u
export PYTHONPATH=$PWD/src:$PWD MINIVLLM_GIT_COMMIT=$(cat bench/.commit) HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
S=$(date +%s); R=$OUT/r; mkdir -p $R; t(){ echo "$1 rc=$2 $(( $(date +%s)-S ))s" >> $R/times.log; }
left(){ echo $(( $1 - ($(date +%s)-S) )); }
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader > $R/gpu.txt
timeout 100 python3 -m bench.diagnostics.gemv_sweep --formats fp8 --bn 4,8 --bk 512,1024 --warps 2,4 --stages 1,2,3 --out $R/gemv_sweep_fp8.json > $R/gemv_sweep_fp8.log 2>&1; t sweep_fp8 $?
timeout 60 python3 -m bench.diagnostics.gemv_sweep --formats w16 --bn 4 --bk 1024,2048 --warps 4,8 --stages 1,2,3 --out $R/gemv_sweep_w16.json > $R/gemv_sweep_w16.log 2>&1; t sweep_w16 $?
python3 .ab/pick.py $R/gemv_sweep_fp8.json $R/gemv_sweep_w16.json $R/picks.json > $R/picks.log 2>&1
AB="PYTHONPATH=$PWD/.ab:$PWD/src:$PWD"
P="$AB AB_GEMV_PICK=$R/picks.json"
L=$(left 395); timeout $L python3 -m bench.offline_ab --model llama-3.1-8b --workloads w2 --variant "noprefetch;$AB AB_NO_PREFETCH=1;--quantization fp8" --variant "prefetch;;--quantization fp8" --variant "prefetch_picked;$P;--quantization fp8" --processes 2 --budget-s $((L-5)) --process-limit-s 60 --out $R/w2_fp8_ab > $R/w2_fp8_ab.log 2>&1; t ab_fp8 $?
L=$(left 520); timeout $L python3 -m bench.offline_ab --model llama-3.1-8b --workloads w2 --variant "noprefetch;$AB AB_NO_PREFETCH=1;" --variant "prefetch_picked;$P;" --processes 2 --budget-s $((L-5)) --process-limit-s 60 --out $R/w2_bf16_ab > $R/w2_bf16_ab.log 2>&1; t ab_bf16 $?
L=$(left 580); timeout $L python3 -m bench.offline_ab --model llama-3.1-8b --workloads w2 --variant "noprefetch;$AB AB_NO_PREFETCH=1;--quantization int4" --variant "prefetch;;--quantization int4" --processes 1 --budget-s $((L-5)) --process-limit-s 60 --out $R/w2_int4_ab > $R/w2_int4_ab.log 2>&1; t ab_int4 $?
cat $R/picks.log; cat $R/times.log
for f in $R/w2_*_ab.log; do echo == $f; tail -8 $f; done
tar czf $OUT/callA.tgz -C $OUT r
