# the sweep and a first A/B (its variant failed to start: the config list's ';' split the variant string)
set -u
export PYTHONPATH=$PWD/src:$PWD MINIVLLM_GIT_COMMIT=$(cat bench/.commit) HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
S=$(date +%s); R=$OUT/r; mkdir -p $R; t(){ echo "$1 rc=$2 $(( $(date +%s)-S ))s" >> $R/times.log; }
left(){ echo $(( $1 - ($(date +%s)-S) )); }
timeout 150 python3 -m bench.diagnostics.int4_mma_sweep --rows 1 --out $R/int4_split_sweep.json > $R/sweep.log 2>&1; t sweep $?
cat $R/sweep.log | cut -c1-200
CFG=$(python3 -c "
import json,re
d=json.load(open('$R/int4_split_sweep.json'))
best={}
for r in d['rows']:
    if r['kernel'].startswith('mma') and 'us' in r and r['rel_err']<1e-2:
        k=(r['N'],r['K'])
        if k not in best or r['us']<best[k][0]: best[k]=(r['us'],r['kernel'])
print(';'.join(f'{n}:{k}:'+','.join(re.findall(r'\d+',lab)) for (n,k),(us,lab) in best.items()))
" 2>>$R/times.log); echo "CFG=$CFG" >> $R/times.log
A="PYTHONPATH=$PWD/.ab:$PWD/src:$PWD AB_INT4_CFG=$CFG"
L=$(left 400); timeout $L python3 -m bench.offline_ab --model llama-3.1-8b --workloads w2 \
  --variant "int4_shipped;;--quantization int4" --variant "int4_swept;$A;--quantization int4" \
  --processes 2 --budget-s $((L-5)) --process-limit-s 80 --out $R/ab > $R/ab.log 2>&1; t ab $?
tail -6 $R/ab.log; cat $R/times.log
tar czf $OUT/out.tgz -C $OUT r
# the A/B, another call
set -u
export PYTHONPATH=$PWD/src:$PWD MINIVLLM_GIT_COMMIT=$(cat bench/.commit) HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
S=$(date +%s); R=$OUT/r; mkdir -p $R
A="PYTHONPATH=$PWD/.ab:$PWD/src:$PWD AB_INT4_CFG=4096:14336:16,8,8,4,3,2"
timeout 230 python3 -m bench.offline_ab --model llama-3.1-8b --workloads w2 \
  --variant "int4_shipped;;--quantization int4" --variant "int4_down_split2;$A;--quantization int4" \
  --processes 2 --budget-s 225 --process-limit-s 60 --out $R/ab > $R/ab.log 2>&1; echo "ab rc=$? $(( $(date +%s)-S ))s" >> $R/ab.log
tail -7 $R/ab.log
tar czf $OUT/out.tgz -C $OUT r
# the GPU tests with the rule shipped, a third call
set -u
export PYTHONPATH=$PWD/src:$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
timeout 170 python3 -m pytest -q -p no:cacheprovider -m gpu --durations=3 tests/test_gpu_quantization.py tests/test_triton_kernels.py -k "int4_tensor_core_kernel or (launched_early and int4) or (graphs_match_eager and int4)" > $R/gpu_int4_split_tests.log 2>&1; echo "rc=$?" >> $R/gpu_int4_split_tests.log
tail -8 $R/gpu_int4_split_tests.log
