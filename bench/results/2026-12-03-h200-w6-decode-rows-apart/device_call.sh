# (1) the prefill kernel on W6's shapes: the prompt alone, with the decode rows (engine's
# order), the decode rows through each kernel, and decode_rows_apart; quick tile sweep too.
# (2) W6 / W5 A/B: decode_rows_apart in the engine (hook) against shipped.
set -u
export PYTHONPATH=$PWD/src:$PWD MINIVLLM_GIT_COMMIT=$(cat bench/.commit) HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
S=$(date +%s); R=$OUT/r; mkdir -p $R; t(){ echo "$1 rc=$2 $(( $(date +%s)-S ))s" >> $R/times.log; }
left(){ echo $(( $1 - ($(date +%s)-S) )); }
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py -k "decode_rows_apart or mixed or decode" > $R/gpu_tests.log 2>&1; t tests $?
tail -2 $R/gpu_tests.log
timeout 200 python3 bench/attention_tuning.py --models llama-3.1-8b,qwen3-0.6b --shapes w6,w6-mixed,w6-engine --quick --block-size 64 --out $R/attention_tuning_w6.json > $R/tuning.log 2>&1; t tuning $?
tail -8 $R/tuning.log
A="PYTHONPATH=$PWD/.ab:$PWD/src:$PWD AB_DECODE_ROWS_APART=1"
L=$(left 585); timeout $L python3 -m bench.offline_ab --model llama-3.1-8b --workloads w6,w5 \
  --variant "shipped;;" --variant "apart;$A;" \
  --processes 2 --budget-s $((L-5)) --process-limit-s 110 --out $R/ab > $R/ab.log 2>&1; t ab $?
tail -8 $R/ab.log; cat $R/times.log
tar czf $OUT/out.tgz -C $OUT r
