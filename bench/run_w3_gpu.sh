#!/usr/bin/env bash
# W3 serving on a GPU in one device call (under 10 minutes): the Qwen2.5-0.5B config with
# dummy bf16 weights, minivllm's server against its offline engine and transformers serve,
# through one HTTP client (bench/w3_gpu.py).
#
#   bash bench/run_w3_gpu.sh [PART ...]      # on the GPU machine, from the repo root, .whl carried
#
# Parts, in the order given (default: minivllm offline hf-cb hf-plain):
#   minivllm  minivllm's server: concurrency 1 8 32 64 128 256 (2 rounds each), then a ramp
#             384 512 768 1024 (1 round each) until the first failed request, all under
#             --gpu-memory-utilization 0.3                                    (limit T_MINIVLLM)
#   offline   the offline engine (LLMEngine, same flags) on the same requests, c=64 first
#                                                                             (limit T_OFFLINE)
#   hf-cb     transformers serve --continuous-batching, same requests        (limit T_HF_CB)
#   minivllm-apiN  the same server with --api-servers N (N HTTP processes, one engine), e.g.
#             minivllm-api2; no ramp                                     (limit T_MINIVLLM_API)
#   env:LABEL:K=V[,K=V]  the server with those environment variables set, under the label
#             LABEL (an A/B of a switch in one run), e.g. env:minivllm-noprelude:MINIVLLM_DECODE_PRELUDE=0;
#             the ramp only if W3_ARGS asks for it                  (limit as minivllm-apiN)
#   warm      minivllm's server started once and given one request, to fill Triton's kernel
#             cache on a fresh machine (its first start there took 40-45 s instead of
#             24-27, which cut the first measured part short); put it first  (limit T_WARM)
#   hf-plain  transformers serve without continuous batching (one request at a time), c=1
#             and 8, one round each                                          (limit T_HF_PLAIN)
#   gpu       bench.gpu_check w2,sweep,w1 then hf (W1, W2, decode sweep, HF generate peers);
#             not in the default list: give it its own device call        (T_GPU_PERF, T_GPU_HF)
# Every part is one process under `timeout` and watches its own budget; parts share TOTAL_S
# (default 560 s): a part gets min(its limit, what is left). Results: one JSON per part
# (rewritten after every level), server logs, this script's log, and a report rendered from
# them (bench/report.py), tarred into $OUT/results.tgz after every part; the log is also
# copied to $OUT/run_w3_gpu.log.
#
# Knobs: W3_ARGS (extra flags for every bench.w3_gpu part, e.g. "--rounds 1"), MINIVLLM_ARGS
# (extra engine flags), TRANSFORMERS_ARGS, PYTHON (default python3), RES, WORK, OUT.
# W3_SMOKE=1: the same plumbing with a tiny model on the CPU and tiny sizes (no GPU needed).
# The commit: $MINIVLLM_GIT_COMMIT, else bench/.commit (write it before the device call:
# git rev-parse --short HEAD > bench/.commit, and carry it: the device's .git is not ours).
set -u
cd "$(dirname "$0")/.." || exit 1
START=$(date +%s)
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/minivllm-out}
RES=${RES:-/tmp/minivllm-h200}
WORK=${WORK:-/tmp/minivllm-w3}
TOTAL_S=${TOTAL_S:-560}
SMOKE=()
if [ "${W3_SMOKE:-0}" != "0" ]; then SMOKE=(--smoke); fi
PARTS=("$@")
[ ${#PARTS[@]} -eq 0 ] && PARTS=(minivllm offline hf-cb hf-plain)
mkdir -p "$OUT" "$RES" "$WORK"
LOG="$RES/run_w3_gpu.log"

say() { echo "[run_w3_gpu +$(( $(date +%s) - START ))s] $*" | tee -a "$LOG"; }
pack() {
  tar czf "$OUT/results.tgz.tmp" -C "$RES" . 2>/dev/null && mv "$OUT/results.tgz.tmp" "$OUT/results.tgz"
  cp "$LOG" "$OUT/run_w3_gpu.log" 2>/dev/null
}
left() { echo $(( TOTAL_S - ($(date +%s) - START) )); }

# ---- environment ---------------------------------------------------------------------------
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_HUB_DISABLE_UPDATE_CHECK=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ -z "${MINIVLLM_GIT_COMMIT:-}" ]; then
  MINIVLLM_GIT_COMMIT=$(cat bench/.commit 2>/dev/null || git rev-parse --short HEAD 2>/dev/null || echo unknown)
fi
export MINIVLLM_GIT_COMMIT
say "parts: ${PARTS[*]}; budget ${TOTAL_S}s; commit $MINIVLLM_GIT_COMMIT; smoke ${W3_SMOKE:-0}"

if ! "$PY" -c "import fastapi, uvicorn, pydantic, orjson" 2>/dev/null; then
  if ls .whl/*.whl >/dev/null 2>&1; then
    say "installing the server wheels from .whl into /tmp/site"
    timeout 180 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
      --upgrade --target /tmp/site .whl/*.whl >>"$LOG" 2>&1 || say "wheel install failed"
    export PYTHONPATH="/tmp/site:$PYTHONPATH"
  else
    say "fastapi/uvicorn/pydantic/orjson missing and no .whl/ here (run /work/shared/gpu/fetch-server-wheels.sh and carry .whl)"
  fi
fi
"$PY" - >>"$LOG" 2>&1 <<'EOF'
import importlib, sys
print("python", sys.version.split()[0])
for m in ("torch", "triton", "transformers", "fastapi", "uvicorn", "pydantic", "orjson",
          "httpx", "httpx2", "pynvml", "matplotlib", "httptools"):
    try:
        print(m, getattr(importlib.import_module(m), "__version__", "?"))
    except Exception as e:
        print(m, "MISSING", type(e).__name__, e)
EOF
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,driver_version --format=csv \
    >"$RES/nvidia-smi.txt" 2>&1
  cat "$RES/nvidia-smi.txt" >>"$LOG"
fi
pack

# ---- parts ---------------------------------------------------------------------------------
end_leftover_server() {  # a part killed by `timeout -k` may leave its server behind
  if [ -f "$WORK/server.pid" ]; then
    local pid; pid=$(cat "$WORK/server.pid")
    if kill -0 "$pid" 2>/dev/null; then
      say "ending leftover server process group $pid"
      kill -INT -- "-$pid" 2>/dev/null; sleep 5
      kill -KILL -- "-$pid" 2>/dev/null
    fi
    rm -f "$WORK/server.pid"
  fi
}

run_part() {  # run_part NAME DEFAULT_LIMIT_S COMMAND...
  local name=$1 limit=$2; shift 2
  local remain; remain=$(( $(left) - 20 ))
  [ "$limit" -gt "$remain" ] && limit=$remain
  if [ "$limit" -lt 30 ]; then
    say "$name: skipped, ${remain}s left"
    return
  fi
  say "$name: start (limit ${limit}s)"
  local t0; t0=$(date +%s)
  # The part stops itself within its budget; timeout is the backstop (SIGINT: it still
  # writes its JSON and stops its server).
  timeout -s INT -k 20 $(( limit + 10 )) "$@" --budget-s "$limit" >>"$LOG" 2>&1
  local rc=$?
  end_leftover_server
  say "$name: exit $rc after $(( $(date +%s) - t0 ))s"
  pack
}

W3=("$PY" -m bench.w3_gpu)
COMMON=(--work "$WORK" --out-dir "$RES" --log-dir "$RES/logs" "${SMOKE[@]}")
# shellcheck disable=SC2206
EXTRA=(${W3_ARGS:-})
MV=("--minivllm-args=${MINIVLLM_ARGS:-}")  # '=': the value may start with '--'
TF=("--transformers-args=${TRANSFORMERS_ARGS:-}")

run_gpu_check() {
  local sections=$1 limit=$2; shift 2
  local remain; remain=$(( $(left) - 20 ))
  [ "$limit" -gt "$remain" ] && limit=$remain
  if [ "$limit" -lt 30 ]; then say "gpu_check $sections: skipped"; return; fi
  say "gpu_check $sections: start (limit ${limit}s)"
  env "$@" timeout -k 20 "$limit" "$PY" -m bench.gpu_check --sections "$sections" \
    --out-dir "$RES" "${SMOKE[@]}" >>"$LOG" 2>&1
  say "gpu_check $sections: exit $?"
  pack
}

for part in "${PARTS[@]}"; do
  case $part in
    minivllm) run_part minivllm "${T_MINIVLLM:-170}" "${W3[@]}" minivllm "${COMMON[@]}" "${MV[@]}" "${EXTRA[@]}" ;;
    minivllm-api[0-9]*)
      n=${part#minivllm-api}
      run_part "$part" "${T_MINIVLLM_API:-150}" "${W3[@]}" minivllm --label "$part" --ramp "${COMMON[@]}" "--minivllm-args=--api-servers $n ${MINIVLLM_ARGS:-}" "${EXTRA[@]}" ;;
    env:*)  # env:LABEL:K=V[,K=V...]: the server under those environment variables; no ramp
      spec=${part#env:}; label=${spec%%:*}; kv=${spec#*:}
      run_part "$label" "${T_MINIVLLM_API:-150}" env ${kv//,/ } "${W3[@]}" minivllm --label "$label" "${COMMON[@]}" "${MV[@]}" "${EXTRA[@]}" ;;
    warm)     run_part warm "${T_WARM:-90}" "${W3[@]}" minivllm --label warm "${COMMON[@]}" "${MV[@]}" "${EXTRA[@]}" --concurrency 1 --rounds 1 --min-requests 1 --ramp ;;
    offline)  run_part offline "${T_OFFLINE:-100}" "${W3[@]}" offline "${COMMON[@]}" "${MV[@]}" "${EXTRA[@]}" ;;
    hf-cb)    run_part hf-cb "${T_HF_CB:-160}" "${W3[@]}" transformers "${COMMON[@]}" "${TF[@]}" "${EXTRA[@]}" ;;
    hf-plain) run_part hf-plain "${T_HF_PLAIN:-90}" "${W3[@]}" transformers --plain --rounds 1 --min-requests 2 "${COMMON[@]}" "${TF[@]}" "${EXTRA[@]}" ;;
    gpu)
      run_gpu_check "${GPU_PERF_SECTIONS:-w2,sweep,w1}" "${T_GPU_PERF:-220}" MINIVLLM_COMPILE=0 GPU_CHECK_SKIP_COMPILE=1
      run_gpu_check "${GPU_HF_SECTIONS:-hf}" "${T_GPU_HF:-150}" ;;
    *) say "unknown part $part (warm minivllm minivllm-apiN env:LABEL:K=V offline hf-cb hf-plain gpu)" ;;
  esac
done

# ---- summary and report --------------------------------------------------------------------
grep -hE "^\[w3_gpu\] .*(c=|ramp|healthy|error|Error)|^(W1|W2|HF|sweep)" "$LOG" | tail -60
if [ "$(left)" -gt 15 ]; then
  timeout 60 "$PY" -m bench report --results "$RES" --out "$RES/report" >>"$LOG" 2>&1 \
    && say "report: $RES/report/report.md" || say "report failed (see log)"
fi
say "done"
pack
