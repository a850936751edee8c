#!/usr/bin/env bash
# W8 (structured outputs, bench/w8_structured.py) for minivllm and vLLM 0.26 in one device
# call, each engine in a process of its own, one after the other, for each model config named
# (bench/model_configs/NAME.json; default qwen2.5-0.5b-instruct and llama-3.1-8b), all with
# the Qwen2.5 tokenizer the vLLM bundle unpacks into /tmp/qwen25. Run after
# `source .vllm/install.sh` (see bench/run_vs_vllm.sh for the bundle's three calls; vLLM's
# site holds xgrammar for both engines). Results: $OUT/w8/MODEL-ENGINE.json (offline) and,
# through the servers at c=64 (bench/w3_gpu.py --structured: every other request carries a
# schema; and the same without), $OUT/w8/server-MODEL-KIND/w3_ENGINE-w8-KIND.json.
# W8_PARTS: "offline server" (default); W8_SPEC=1 adds offline runs with n-gram speculation
# (MODEL-ENGINE-ngram.json: minivllm drafts the text a grammar forces).
# Carry .whl: the server wheels (bash ../shared/gpu/fetch-server-wheels.sh; minivllm's server
# needs orjson, which vLLM's site lacks) and lm-format-enforcer's (MINIVLLM_DEVICE_WHEELS=
# "lm-format-enforcer interegular" with the same script: vLLM's structured outputs import
# every backend, that one included, and its bundle lacks it).
set -u
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-/tmp/minivllm-out}
pip_target() { python3 -m pip install -q --no-index --no-deps --no-compile --target "$@"; }
if [ -n "${VLLM_SITE:-}" ] && ls .whl/lm_format_enforcer-*.whl >/dev/null 2>&1 &&
   ! PYTHONPATH=$VLLM_SITE python3 -c "import lmformatenforcer" 2>/dev/null; then
  pip_target "$VLLM_SITE" .whl/lm_format_enforcer-*.whl .whl/interegular-*.whl
fi
ls .whl/*.whl >/dev/null 2>&1 && pip_target /tmp/site --upgrade .whl/*.whl
# vLLM's site before the wheels: vLLM keeps its own pydantic and fastapi.
export PYTHONPATH="$PWD/src:$PWD${VLLM_SITE:+:$VLLM_SITE}:/tmp/site"
export MINIVLLM_GIT_COMMIT=${MINIVLLM_GIT_COMMIT:-$(cat bench/.commit 2>/dev/null || echo unknown)}
TOK=${W8_TOKENIZER:-/tmp/qwen25}
MODELS=("$@")
[ ${#MODELS[@]} -eq 0 ] && MODELS=(qwen2.5-0.5b-instruct llama-3.1-8b)
mkdir -p "$OUT/w8"
PARTS=${W8_PARTS:-offline server}
for model in "${MODELS[@]}"; do
  [[ " $PARTS " == *" offline "* ]] && for engine in minivllm vllm; do
    timeout "${T_W8:-240}" python3 -m bench.w8_structured --engine "$engine" \
      --config "bench/model_configs/$model.json" --tokenizer "$TOK" \
      --out "$OUT/w8/$model-$engine.json" > "$OUT/w8/$model-$engine.log" 2>&1
    echo "$model $engine rc=$?"; tail -3 "$OUT/w8/$model-$engine.log"
    [ -n "${W8_SPEC:-}" ] && timeout "${T_W8:-240}" python3 -m bench.w8_structured \
      --engine "$engine" --speculative --config "bench/model_configs/$model.json" \
      --tokenizer "$TOK" --out "$OUT/w8/$model-$engine-ngram.json" \
      > "$OUT/w8/$model-$engine-ngram.log" 2>&1
  done
  [[ " $PARTS " == *" server "* ]] && for kind in structured plain; do
    flag=(); [ "$kind" = structured ] && flag=(--structured)
    for engine in minivllm vllm; do
      timeout "${T_W8_SERVER:-200}" python3 -m bench.w3_gpu "$engine" "${flag[@]}" \
        --model-config "bench/model_configs/$model.json" --tokenizer-dir "$TOK" \
        --concurrency 64 --ramp --plain-concurrency 1 --budget-s "${T_W8_SERVER:-200}" \
        --label "$engine-w8-$kind" --out-dir "$OUT/w8/server-$model-$kind" \
        > "$OUT/w8/server-$model-$kind-$engine.log" 2>&1
      echo "$model server $kind $engine rc=$?"; grep "c=64" "$OUT/w8/server-$model-$kind-$engine.log" | tail -1
    done
  done
done
