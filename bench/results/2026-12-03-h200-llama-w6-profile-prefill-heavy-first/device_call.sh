# Llama-3.1-8B W6 (bf16) by kernel, PDL off so that no kernel's time includes its wait;
# A/B: head_dim 128's prefill tiles heaviest first on long queries (W5, W6).
set -u
export PYTHONPATH=$PWD/src:$PWD MINIVLLM_GIT_COMMIT=$(cat bench/.commit) HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
S=$(date +%s); R=$OUT/r; mkdir -p $R; t(){ echo "$1 rc=$2 $(( $(date +%s)-S ))s" >> $R/times.log; }
left(){ echo $(( $1 - ($(date +%s)-S) )); }
MINIVLLM_PDL=0 timeout 170 python3 -m bench.step_profile --model llama-3.1-8b --workload W6 --requests 64 --top 30 --out $R/step_profile_llama8b_w6_no_pdl.json > $R/w6.log 2>&1; t w6 $?
tail -2 $R/w6.log
A="PYTHONPATH=$PWD/.ab:$PWD/src:$PWD AB_HEAVY_FIRST_128=1"
L=$(left 560); timeout $L python3 -m bench.offline_ab --model llama-3.1-8b --workloads w5,w6 \
  --variant "shipped;;" --variant "heavy-first;$A;" \
  --processes 2 --budget-s $((L-5)) --process-limit-s 110 --out $R/ab > $R/ab.log 2>&1; t ab $?
tail -8 $R/ab.log; cat $R/times.log
tar czf $OUT/out.tgz -C $OUT r
