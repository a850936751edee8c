#!/usr/bin/env bash
# W8 (structured outputs, bench/w8_structured.py) for minivllm and vLLM 0.26 in one device
# call, each engine in a process of its own, one after the other, for each model config named
# (bench/model_configs/NAME.json; default qwen2.5-0.5b-instruct and llama-3.1-8b), all with
# the Qwen2.5 tokenizer the vLLM bundle unpacks into /tmp/qwen25. Run after
# `source .vllm/install.sh` (see bench/run_vs_vllm.sh for the bundle's three calls; vLLM's
# site holds xgrammar for both engines). Results: $OUT/w8/MODEL-ENGINE.json.
set -u
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-/tmp/minivllm-out}
TOK=${W8_TOKENIZER:-/tmp/qwen25}
MODELS=("$@")
[ ${#MODELS[@]} -eq 0 ] && MODELS=(qwen2.5-0.5b-instruct llama-3.1-8b)
mkdir -p "$OUT/w8"
for model in "${MODELS[@]}"; do
  for engine in minivllm vllm; do
    timeout "${T_W8:-240}" python3 -m bench.w8_structured --engine "$engine" \
      --config "bench/model_configs/$model.json" --tokenizer "$TOK" \
      --out "$OUT/w8/$model-$engine.json" > "$OUT/w8/$model-$engine.log" 2>&1
    echo "$model $engine rc=$?"; tail -3 "$OUT/w8/$model-$engine.log"
  done
done
