"""Accuracy of each quantization method on the real SmolLM2-135M-Instruct (real weights).

For the unquantized model and each method (fp8, int8, int4): perplexity on a fixed text
shipped here (bench/data/public_domain_prose.txt: the Declaration of Independence, the
Gettysburg Address and Lincoln's second inaugural address, ~2,900 tokens, in windows of
--window tokens, each scored from its own start), greedy-token agreement with the
unquantized model on fixed chat prompts (the share of each output before its first
divergence, and how many outputs are identical), and the bytes of the weights.
"kv-fp8" in --methods is the unquantized model with kv_cache_dtype="fp8".
Usage: OMP_NUM_THREADS=1 python -m bench.quant_accuracy [--methods fp8,int8,int4,kv-fp8]
       [--max-tokens 64] [--window 512] [--device auto] [--dtype auto] [--out FILE]
"""

from __future__ import annotations

import argparse
import math
import os
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

from bench.common import print_table, write_result  # noqa: E402

TEXT = Path(__file__).parent / "data" / "public_domain_prose.txt"
PROMPTS = [
    "Write a short story about a dragon who learns to cook.",
    "Explain why the sky is blue.",
    "Give me three tips for learning to play the guitar.",
    "What are the benefits of regular exercise?",
    "Describe a walk through a forest in autumn.",
    "Write a poem about the sea.",
    "How does a bicycle work?",
    "What would you pack for a weekend camping trip?",
    "Summarize the plot of Romeo and Juliet in three sentences.",
    "What is the difference between weather and climate?",
    "Write a Python function that reverses a string.",
    "List five countries in South America and their capitals.",
    "Why do cats purr?",
    "Explain what a prime number is to a ten-year-old.",
    "Give me a recipe for pancakes.",
    "What causes the seasons on Earth?",
]


def perplexity(llm, token_ids: list[int], window: int) -> tuple[float, int]:
    """exp(mean negative log-likelihood) over the text's tokens, each window of `window`
    tokens scored from its own start (its first token is context only)."""
    from minivllm import SamplingParams

    windows = [token_ids[i:i + window] for i in range(0, len(token_ids), window)]
    windows = [w for w in windows if len(w) > 1]
    outs = llm.generate([{"prompt_token_ids": w} for w in windows],
                        SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    nll, count = 0.0, 0
    for w, out in zip(windows, outs):
        for tok, pos in zip(w[1:], out.prompt_logprobs[1:]):
            nll -= pos[tok].logprob
            count += 1
    return math.exp(nll / count), count


def agreement(outputs: list[list[int]], reference: list[list[int]]) -> tuple[float, int]:
    """(mean share of each reference output before the first differing token, identical
    outputs)."""
    shares, same = [], 0
    for got, want in zip(outputs, reference):
        n = 0
        while n < min(len(got), len(want)) and got[n] == want[n]:
            n += 1
        shares.append(n / max(1, len(want)))
        same += got == want
    return sum(shares) / len(shares), same


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--methods", default="fp8,int8,int4")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from minivllm import LLM, SamplingParams
    from minivllm.default_model import ensure_default_model

    model_dir = ensure_default_model()
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    messages = [[{"role": "user", "content": p}] for p in PROMPTS]
    rows, reference = [], None
    for method in [None] + args.methods.split(","):
        start = time.perf_counter()
        kv_fp8 = method == "kv-fp8"  # the KV cache in e4m3, the weights as they are
        llm = LLM(str(model_dir), quantization=None if kv_fp8 else method,
                  kv_cache_dtype="fp8" if kv_fp8 else "auto", device=args.device,
                  dtype=args.dtype,
                  max_model_len=max(1024, args.window + 8), max_num_seqs=len(PROMPTS),
                  gpu_memory_utilization=0.3)
        text_ids = llm.engine.tokenize(TEXT.read_text())
        ppl, scored = perplexity(llm, text_ids, args.window)
        outs = [o.outputs[0].token_ids for o in llm.chat(messages, params, use_tqdm=False)]
        if reference is None:
            reference = outs
        share, same = agreement(outs, reference)
        rows.append({"method": method or "none", "perplexity": round(ppl, 3),
                     "tokens_scored": scored,
                     "agreement_before_divergence": round(share, 3),
                     "identical_outputs": f"{same}/{len(outs)}",
                     "weight_bytes": llm.engine.runner.weight_bytes(),
                     "kv_cache_tokens": llm.engine.runner.num_blocks * llm.engine.config.block_size,
                     "seconds": round(time.perf_counter() - start, 1)})
        print(rows[-1], flush=True)
        dtype, device = str(llm.engine.dtype).removeprefix("torch."), str(llm.engine.device)
        del llm
    base = rows[0]["perplexity"]
    for r in rows:
        r["perplexity_vs_none"] = round(r["perplexity"] / base, 4)
    print_table(rows, list(rows[0]))
    path = write_result("quant-accuracy", {
        "model": f"SmolLM2-135M-Instruct (real weights, {dtype})", "device": device,
        "text": TEXT.name, "window": args.window, "max_tokens": args.max_tokens,
        "prompts": len(PROMPTS), "rows": rows}, args.out)
    print("wrote", path)


if __name__ == "__main__":
    main()
