# (1) batch-1 decode attention by split count, and the engine graph's plan (grid of 8704);
# (2) Llama W5 / W6 A/B: 128-row prefill tiles for head_dim 128 long queries vs shipped.
set -u
export PYTHONPATH=$PWD/src:$PWD MINIVLLM_GIT_COMMIT=$(cat bench/.commit) HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
S=$(date +%s); R=$OUT/r; mkdir -p $R; t(){ echo "$1 rc=$2 $(( $(date +%s)-S ))s" >> $R/times.log; }
left(){ echo $(( $1 - ($(date +%s)-S) )); }
timeout 150 python3 -m bench.diagnostics.decode_splits --out $R/decode_splits_batch1.json \
  --points 1x128,1x256,1x512,1x1024,1x4096,4x256,8x512 --splits 1,2,4,8,16 --graph-len 8704 > $R/decode_splits.log 2>&1; t splits $?
grep -c us $R/decode_splits.log
A="PYTHONPATH=$PWD/.ab:$PWD/src:$PWD AB_PREFILL_128_LONG=1"
L=$(left 540); timeout $L python3 -m bench.offline_ab --model llama-3.1-8b --workloads w5,w6 \
  --variant "shipped;;" --variant "tiles128;$A;" \
  --processes 2 --budget-s $((L-5)) --process-limit-s 110 --out $R/ab > $R/ab.log 2>&1; t ab $?
tail -6 $R/ab.log; cat $R/times.log
tar czf $OUT/out.tgz -C $OUT r
