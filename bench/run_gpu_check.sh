#!/usr/bin/env bash
# GPU checks and benchmarks for one device call; results packed into $OUT/results.tgz.
# Each group runs in its own process under a time limit, so a crash or a slow peer in one
# group still leaves the others' results. Groups (default: all, ~11 minutes — more than one
# device call allows, so name groups to split the work over calls):
#   tests   the kernels' GPU tests (compiled Triton, realistic shapes, graph replay)
#   features  each engine feature in its own process (eager, fused kernels, decode graphs,
#           mixed-step graphs, pipelining, torch.compile), tokens compared with eager
#   perf    W2, decode sweep, W1 (CUDA graphs, no torch.compile)
#   w2-compile  W2 with CUDA graphs, then with the decode step torch.compile'd too
#   graphs  CUDA-graph decode vs eager decode, fp32 and bf16 (GPU_CHECK_GRAPHS_COMPILE=1: compiled)
#   parity  fp32 greedy vs HF transformers (three dummy-weight configs)
#   bf16    bf16 vs HF bf16 divergence
#   hf      HF peers: generate eager, generate_batch, static cache + compile
#   profile top kernels of eager decode steps (torch.profiler), batch 1 and 64
#   kernels bench/kernel_check.py: the attention kernels vs the reference, bandwidth
#   moe     a mixture of experts (MOE_MODEL, default qwen3-30b-a3b): the MoE tiles at MOE_TOKENS
#           (default 1 2 4 8) for MOE_DTYPES, then a W2 step profile in MOE_QUANT (fp8; "" for bf16)
#   replay-state  bench/diagnostics/replay_state.py, each sequence of actions in
#           REPLAY_STATE_SEQS (space-separated) in its own process
#   s:A,B   the named bench.gpu_check sections (no torch.compile), e.g. s:w2
# Same-call A/Bs: GPU_CHECK_W2_VARIANTS=graphs,no-prelude,graphs (bench.gpu_check's W2
# variants), GPU_CHECK_W1_VARIANTS=default,no-prelude,default (W1's).
# Usage (on the GPU machine, from the repo root): bash bench/run_gpu_check.sh [GROUP ...]
set -u
START=$(date +%s)
TOTAL_S=${TOTAL_S:-570}  # the whole call's budget: a group gets min(its limit, what is left)
# The device's copy of .git is not ours: the commit comes from bench/.commit (carry it).
export MINIVLLM_GIT_COMMIT=${MINIVLLM_GIT_COMMIT:-$(cat bench/.commit 2>/dev/null || echo unknown)}
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/minivllm-out}
RES=/tmp/minivllm-results
OUT_NAME=${OUT_NAME:-results.tgz}  # the tarball under $OUT
mkdir -p "$OUT" "$RES"
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv | tee "$RES/nvidia-smi.txt"
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
pack() {  # after every group, so a call killed at its limit still returns what ran
  tar czf "$OUT/$OUT_NAME.tmp" -C "$RES" . 2>/dev/null && mv "$OUT/$OUT_NAME.tmp" "$OUT/$OUT_NAME"
}
budget() {  # budget LIMIT_S -> min(LIMIT_S, seconds left - 10)
  local left=$(( TOTAL_S - ($(date +%s) - START) - 10 ))
  [ "$1" -lt "$left" ] && echo "$1" || echo "$left"
}
run() {  # run LIMIT_S SECTIONS [ENV...]
  local limit sections=$2; limit=$(budget "$1"); shift 2
  if [ "$limit" -lt 20 ]; then echo "[$sections] skipped: out of time" | tee -a "$RES/gpu_check.log"; return; fi
  env "$@" timeout "$limit" python3 -m bench.gpu_check --sections "$sections" --out-dir "$RES" \
    >>"$RES/gpu_check.log" 2>&1
  echo "[$sections] exit $? at +$(( $(date +%s) - START ))s" | tee -a "$RES/gpu_check.log"
  pack
}
groups=${*:-tests features perf graphs parity bf16 hf}
for g in $groups; do
  case $g in
    tests)
      # Every test marked gpu by default (kernels, engine paths, sampler and grammar masks,
      # quantization, families, MoE, tensor parallelism on two GPUs); GPU_TEST_FILES narrows.
      # The whole set takes longer than one call (tests/test_gpu_sampler.py alone took 285 s,
      # mostly Triton compiling): split it by file over calls. xgrammar (the grammar masks'
      # tests) comes from the vLLM bundle's site when it is installed (source .vllm/install.sh).
      xgr=""
      python3 -c "import xgrammar" 2>/dev/null || xgr=${VLLM_SITE:+:$VLLM_SITE}
      PYTHONPATH="$PYTHONPATH$xgr" timeout "$(budget "${T_TESTS:-400}")" python3 -m pytest -q \
        --maxfail=5 -m gpu ${GPU_TEST_FILES:-tests} >"$RES/gpu_tests.log" 2>&1
      echo "[gpu tests] exit $?" | tee -a "$RES/gpu_check.log"; tail -3 "$RES/gpu_tests.log" ;;
    features)
      for f in ${FEATURE_LIST:-eager eager-fused decode-graphs mixed-graphs pipelined compiled}; do
        env_args=$(python3 -c "from bench.gpu_check import FEATURES; \
print(' '.join(f'{k}={v}' for k, v in FEATURES['$f'][1].items()))")
        run "${T_FEATURE:-90}" feature GPU_CHECK_FEATURE=$f $env_args
      done
      run 30 features_compare ;;
    perf) run "${T_PERF:-200}" w2,sweep,w1 MINIVLLM_COMPILE=0 GPU_CHECK_SKIP_COMPILE=1 ;;
    w2-compile) run "${T_W2_COMPILE:-280}" w2 GPU_CHECK_W2_VARIANTS=graphs,compile ;;
    graphs) run "${T_GRAPHS:-200}" graphs ;;
    parity) run "${T_PARITY:-120}" parity ;;
    bf16) run "${T_BF16:-120}" bf16 ;;
    hf) run "${T_HF:-150}" hf ;;
    profile) run "${T_PROFILE:-120}" profile ;;
    kernels)
      timeout "$(budget "${T_KERNELS:-200}")" python3 bench/kernel_check.py --out "$RES/kernel_check.json" \
        >"$RES/kernel_check.log" 2>&1
      echo "[kernels] exit $?" | tee -a "$RES/gpu_check.log"; tail -5 "$RES/kernel_check.log" ;;
    replay-state)
      i=0
      for seq in ${REPLAY_STATE_SEQS:-base,kernel,kernel,down1,kernel,kernel,eager_step}; do
        i=$((i + 1))
        timeout "$(budget "${T_REPLAY_STATE:-90}")" python3 -m bench.diagnostics.replay_state \
          --actions "$seq" --label "seq$i" --out "$RES/replay_state_$i.json" >>"$RES/replay_state.log" 2>&1
        echo "[replay-state $seq] exit $?" | tee -a "$RES/gpu_check.log"
      done
      grep "after" "$RES/replay_state.log" ;;
    moe)
      # A mixture of experts at decode sizes: its kernels' tiles (bench/moe_tuning.py, timed
      # inside CUDA graphs; the merged table lands in the results), then where a W2 token's
      # time goes in the whole model (bench/step_profile.py, with those tiles).
      limit=$(budget "${T_MOE_TUNING:-200}") quant=${MOE_QUANT-fp8}  # MOE_QUANT="": bf16
      timeout "$limit" python3 -m bench.moe_tuning --models ${MOE_MODEL:-qwen3-30b-a3b} \
        --dtypes ${MOE_DTYPES:-fp8 bf16} --tokens ${MOE_TOKENS:-1 2 4 8} --redo \
        --budget-s $(( limit - 30 )) >"$RES/moe_tuning.log" 2>&1
      echo "[moe tuning] exit $?" | tee -a "$RES/gpu_check.log"; grep "moe_tuning\]" "$RES/moe_tuning.log"
      cp csrc_triton/moe_tiles.json "$RES/"
      timeout "$(budget "${T_MOE_PROFILE:-180}")" python3 -m bench.step_profile \
        --model ${MOE_MODEL:-qwen3-30b-a3b} --workload W2 --requests 1 \
        ${quant:+--quantization "$quant"} --out "$RES/moe_w2_profile.json" >"$RES/moe_w2_profile.log" 2>&1
      echo "[moe profile] exit $?" | tee -a "$RES/gpu_check.log"; tail -14 "$RES/moe_w2_profile.log" ;;
    s:*) run "${T_SECTIONS:-120}" "${g#s:}" MINIVLLM_COMPILE=0 GPU_CHECK_SKIP_COMPILE=1 ;;
    *) echo "unknown group $g" ;;
  esac
  pack
done
grep -E "^(W1|W2|HF|sweep|parity|graphs|bf16|feature)|exit|FAILED" "$RES/gpu_check.log"
pack
