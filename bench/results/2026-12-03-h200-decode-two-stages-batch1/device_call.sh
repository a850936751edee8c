set -u
export PYTHONPATH=$PWD/src:$PWD MINIVLLM_GIT_COMMIT=$(cat bench/.commit) HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
S=$(date +%s); R=$OUT/r; mkdir -p $R; t(){ echo "$1 rc=$2 $(( $(date +%s)-S ))s" >> $R/times.log; }
left(){ echo $(( $1 - ($(date +%s)-S) )); }
timeout 120 python3 decode_config_sweep.py $R/decode_config_bf16.json > $R/decode_cfg.log 2>&1; t sweep $?
tail -3 $R/decode_cfg.log
# the A/B's variant: the config with the least time summed over W2's contexts (batch 1, 128-384)
DCFG=$(python3 -c "
import json,collections;d=json.load(open('$R/decode_config_bf16.json'));t=collections.Counter()
for r in d['rows']:
    if r['batch']==1 and r['context']<=384: t[str(r['config'])]+=r['us']
c=min((v,k) for k,v in t.items() if k!='shipped');print(','.join(c[1].strip('[]').replace(' ','').split(',')))
" 2>>$R/decode_cfg.log); echo "DCFG=$DCFG" >> $R/times.log
A="PYTHONPATH=$PWD/.ab:$PWD/src:$PWD AB_DECODE_CFG=${DCFG:-128,4,2}"
L=$(left 330); timeout $L python3 -m bench.offline_ab --model llama-3.1-8b --workloads w2 \
  --variant "shipped;;--quantization fp8" --variant "decode_cfg;$A;--quantization fp8" \
  --processes 2 --budget-s $((L-5)) --process-limit-s 75 --out $R/ab > $R/ab.log 2>&1; t ab $?
tail -5 $R/ab.log; cat $R/times.log
tar czf $OUT/out.tgz -C $OUT r
