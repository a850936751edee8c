#!/usr/bin/env bash
# minivllm against vLLM 0.26 in one device call, each model's cells in this one call: for each
# model config named (bench/model_configs/NAME.json; default qwen2.5-0.5b-instruct), the
# offline workloads W1 W2 W5 W6 (bench/vs_vllm.py) and W3 at c = 1 16 64 256
# (bench/w3_gpu.py), each engine in a process of its own and one at a time (the GPU's memory
# back before the next starts), then `bench.vs_vllm merge`: $RES/<model>/vs_vllm.json.
#
#   source .vllm/install.sh || exit 1      # vLLM from ../shared/gpu/vllm-bundle.sh: VLLM_SITE
# A later call that carries other files under .vllm/ finds the earlier calls' pieces gone:
# carry .vllm/a0 and .vllm/a1 in one call (56 MB, without .whl) and copy them to /tmp/vb
# there; the next call carries .vllm/c .vllm/tok .vllm/install.sh .whl and starts with
# `cp /tmp/vb/a0 /tmp/vb/a1 .vllm/ && source .vllm/install.sh`. /tmp/vsite then stays while
# the machine is warm (~30 s between calls). A mixture of experts needs vLLM's MoE ops too:
# bench/vllm_moe_ops.sh makes .vllm/moe; carry it in a call of its own, copied to /tmp/vb.
#   bash bench/run_vs_vllm.sh [MODEL ...]  # from the repo root on the GPU machine, .whl carried
#
# Knobs: VS_PARTS (default "mini-offline vllm-offline mini-w3 vllm-w3"), VS_WORKLOADS
# (default w1,w2,w5,w6; "sweep" adds the decode sweep, rows D1 ... D128), VS_QUANT (both engines' quantization for the offline parts, e.g.
# fp8: its rows are "W1 fp8" and so on), VS_KV_DTYPE (both engines' kv_cache_dtype, e.g. fp8),
# VS_SAMPLING (the offline parts' sampling settings, default greedy; e.g. greedy,sampled,top_p
# runs each workload once per setting, rows "W1", "W1 sampled", "W1 top_p": the names are
# bench/vs_vllm.py's SAMPLING; each setting adds its workloads' time, so raise T_OFFLINE;
# VS_SAMPLING_VLLM gives vLLM's offline part fewer settings, default VS_SAMPLING's),
# W3_GENCONFIG (a generation_config.json, e.g. bench/model_configs/qwen2.5-0.5b-instruct.generation_config.json:
# both W3 servers read it as the model's own, files w3_ENGINE-genconfig.json, rows "W3 genconfig c=N";
# with W3_ARGS="--client-temperature unset" the client sends no temperature either, so the file's
# samples: w3_ENGINE-genconfig-sampled.json, rows "W3 genconfig-sampled c=N"),
# VS_TP / VS_DP (both engines' tensor_parallel_size / data_parallel_size, offline and W3:
# files offline_ENGINE_tpN.json, w3_ENGINE-tpN.json, rows "W1 tp2", "W3 tp2 c=N"; NCCL runs
# with NVLink multicast off, as the GPU hosts require),
# T_OFFLINE / T_OFFLINE_VLLM / T_W3 / T_W3_VLLM (each part's limit, s), TOTAL_S (the call's, 560),
# W3_ARGS (extra bench.w3_gpu flags), RES, OUT. The commit comes from bench/.commit.
set -u
cd "$(dirname "$0")/.." || exit 1
START=$(date +%s)
TOTAL_S=${TOTAL_S:-560}
OUT=${OUT:-/tmp/minivllm-out}
RES=${RES:-/tmp/minivllm-vs-vllm}
WORK=${WORK:-/tmp/minivllm-vs-vllm-work}
MODELS=("$@")
[ ${#MODELS[@]} -eq 0 ] && MODELS=(qwen2.5-0.5b-instruct)
PARTS=${VS_PARTS:-mini-offline vllm-offline mini-w3 vllm-w3}
mkdir -p "$OUT" "$RES" "$WORK"
# A lent machine's /tmp can hold an earlier borrower's files: this call's log starts empty,
# the pack holds only the files this call wrote, and the merge only this commit's runs
# (`merge --commit`).
LOG="$RES/run_vs_vllm.log"
: > "$LOG"
say() { echo "[run_vs_vllm +$(( $(date +%s) - START ))s] $*" | tee -a "$LOG"; }
pack() {
  tar czf "$OUT/results.tgz.tmp" --newer-mtime="@$START" -C "$RES" . 2>/dev/null \
    && mv "$OUT/results.tgz.tmp" "$OUT/results.tgz"
  cp "$LOG" "$OUT/run_vs_vllm.log" 2>/dev/null
}
left() { echo $(( TOTAL_S - ($(date +%s) - START) )); }

export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# Tensor / data parallelism: both engines, offline and W3 (labels -tpN / -dpN).
PAR_FLAGS="" PAR_LABEL=""
[ "${VS_TP:-1}" -gt 1 ] && PAR_FLAGS="--tensor-parallel-size $VS_TP" PAR_LABEL="-tp$VS_TP"
[ "${VS_DP:-1}" -gt 1 ] && PAR_FLAGS="$PAR_FLAGS --data-parallel-size $VS_DP" PAR_LABEL="$PAR_LABEL-dp$VS_DP"
export MINIVLLM_GIT_COMMIT=${MINIVLLM_GIT_COMMIT:-$(cat bench/.commit 2>/dev/null || echo unknown)}
MINI_PATH="$PWD/src:$PWD"
if ! python3 -c "import fastapi, uvicorn, pydantic, orjson" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  timeout 180 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target /tmp/site .whl/*.whl >>"$LOG" 2>&1 || say "server wheel install failed"
fi
[ -d /tmp/site ] && MINI_PATH="$MINI_PATH:/tmp/site"
[ -n "${VLLM_SITE:-}" ] || say "VLLM_SITE is not set: the vLLM parts will fail (source .vllm/install.sh)"
# vLLM's MoE ops, left out of the bundle (bench/vllm_moe_ops.sh): unpacked when carried.
for moe in .vllm/moe /tmp/vb/moe; do
  if [ -n "${VLLM_SITE:-}" ] && [ -f "$moe" ] \
     && [ ! -f "$VLLM_SITE/vllm/_moe_C_stable_libtorch.abi3.so" ]; then
    tar -xJf "$moe" -C "$VLLM_SITE" && say "vLLM's MoE ops unpacked from $moe"
  fi
done
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$LOG"

wait_gpu_free() {  # until the GPU's used memory is under 2 GiB (60 s at most)
  local i used
  for i in $(seq 60); do
    used=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -1)
    [ "${used:-0}" -lt 2048 ] && return
    sleep 1
  done
  say "GPU memory still in use after 60 s: ${used} MiB"
}

part() {  # part NAME LIMIT_S PYTHONPATH COMMAND...
  local name=$1 limit=$2 path=$3; shift 3
  local remain=$(( $(left) - 15 ))
  [ "$limit" -gt "$remain" ] && limit=$remain
  if [ "$limit" -lt 30 ]; then say "$name: skipped, ${remain}s left"; return; fi
  wait_gpu_free
  say "$name: start (limit ${limit}s)"
  PYTHONPATH="$path" timeout -s INT -k 20 "$limit" "$@" >>"$LOG" 2>&1
  say "$name: exit $?"
  pack
}

for model in "${MODELS[@]}"; do
  dir="$RES/$model"; mkdir -p "$dir"
  off=(python3 -m bench.vs_vllm offline --model "$model" --workloads "${VS_WORKLOADS:-w1,w2,w5,w6}"
       --out "$dir" --work "$WORK" ${VS_QUANT:+--quantization "$VS_QUANT"}
       ${VS_KV_DTYPE:+--kv-cache-dtype "$VS_KV_DTYPE"} --sampling "${VS_SAMPLING:-greedy}"
       $PAR_FLAGS)
  # 8 rounds a level: at c=256, 2 rounds are 512 requests, under 2 s of minivllm's time with
  # its ramp: 39k tok/s in one call, 59-61k with 8 rounds in another (2026-12-02's
  # vs-vllm-qwen2.5-0.5b and w3-two-api-servers).
  # shellcheck disable=SC2206
  w3=(python3 -m bench.w3_gpu --work "$WORK/w3-$model" --out-dir "$dir" --log-dir "$dir/logs"
      --model-config "bench/model_configs/$model.json" --concurrency 1 16 64 256 --ramp
      --rounds 8 --gpu-memory-utilization 0.9
      ${W3_GENCONFIG:+--generation-config-json "$W3_GENCONFIG"} ${W3_ARGS:-})
  for p in $PARTS; do
    case $p in
      mini-offline) part "$model minivllm offline" "${T_OFFLINE:-240}" "$MINI_PATH" "${off[@]}" --engine minivllm ;;
      vllm-offline) part "$model vllm offline" "${T_OFFLINE_VLLM:-${T_OFFLINE:-240}}" "${VLLM_SITE:-}:$PWD" "${off[@]}" --engine vllm \
                      ${VS_SAMPLING_VLLM:+--sampling "$VS_SAMPLING_VLLM"} ;;
      mini-w3) part "$model minivllm W3" "${T_W3:-150}" "$MINI_PATH" "${w3[@]:0:3}" minivllm "${w3[@]:3}" --budget-s $(( ${T_W3:-150} - 15 )) \
                 ${PAR_LABEL:+--label "minivllm$PAR_LABEL" --minivllm-args "$PAR_FLAGS"} ;;
      # vLLM's server took 115 s to start cold (compile and capture), 77 s warm: a W3
      # limit of 150 s measured nothing.
      vllm-w3) part "$model vllm W3" "${T_W3_VLLM:-260}" "$MINI_PATH" "${w3[@]:0:3}" vllm "${w3[@]:3}" --budget-s $(( ${T_W3_VLLM:-260} - 15 )) \
                 ${PAR_LABEL:+--label "vllm$PAR_LABEL" --vllm-args "$PAR_FLAGS"} ;;
      *) say "unknown part $p" ;;
    esac
  done
  PYTHONPATH="$MINI_PATH" python3 -m bench.vs_vllm merge "$dir" --commit "$MINIVLLM_GIT_COMMIT" \
    >>"$LOG" 2>&1 && say "$model: $dir/vs_vllm.json"
  pack
done
grep -hE "\[vs_vllm\].*(rep [0-9]|ratio|failed|ready)|\[w3_gpu\].* c=|exit|skipped" "$LOG" | tail -90
say "done"
pack
