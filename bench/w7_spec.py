"""W7: speculative decoding on the real SmolLM2-135M-Instruct (greedy, real weights).

Chat prompts of two kinds: lookup-friendly (repeat, extract from or lightly edit a quoted
text) and open-ended. Each kind runs single stream (one request at a time) and as a batch
of 8, with and without n-gram speculation, in this one process: output tok/s, the
speed-up, the acceptance rate (accepted / proposed drafts) and the mean tokens per
verified step; every speculative output is checked token for token against the plain one.
Usage: OMP_NUM_THREADS=1 python -m bench.w7_spec [--k 4] [--max-tokens 96]
       [--kinds lookup,open] [--modes single,batch] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

from bench.common import print_table, write_result  # noqa: E402

PASSAGE = ("The lighthouse keeper climbed the narrow stairs every evening at dusk, carrying a "
           "small brass lamp and a notebook in which he wrote the names of the ships that "
           "passed the rocky point during the night.")
LOOKUP = [
    f"Repeat the following text exactly, word for word: {PASSAGE}",
    f"Rewrite this text with 'lighthouse keeper' replaced by 'old sailor', changing "
    f"nothing else: {PASSAGE}",
    f"Copy out the first sentence of this text: {PASSAGE}",
    "Repeat this list exactly: apples, oranges, pears, plums, cherries, grapes, lemons, "
    "limes, peaches, apricots, figs, dates.",
    f"Here is a text: {PASSAGE} Quote the part about the notebook.",
    "Repeat exactly: def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n",
    f"Say this back to me: {PASSAGE}",
    "Repeat these words: red green blue red green blue red green blue red green blue.",
]
OPEN = [
    "Write a short story about a dragon who learns to cook.",
    "Explain why the sky is blue.",
    "Give me three tips for learning to play the guitar.",
    "What are the benefits of regular exercise?",
    "Describe a walk through a forest in autumn.",
    "Write a poem about the sea.",
    "How does a bicycle work?",
    "What would you pack for a weekend camping trip?",
]


def run(llm, prompts, params, batch: bool) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    if batch:
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params,
                        use_tqdm=False)
    else:
        outs = [llm.chat([{"role": "user", "content": p}], params, use_tqdm=False)[0]
                for p in prompts]
    secs = time.perf_counter() - start
    return secs, [o.outputs[0].token_ids for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--lookup-max", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--prompts", type=int, default=8, help="per kind")
    ap.add_argument("--kinds", default="lookup,open")
    ap.add_argument("--modes", default="single,batch")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from minivllm import LLM, SamplingParams
    from minivllm.default_model import ensure_default_model

    model_dir = ensure_default_model()
    spec_cfg = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 2,
                "prompt_lookup_max": args.lookup_max}
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    engines = {"plain": LLM(str(model_dir), max_model_len=1024, max_num_seqs=8),
               "ngram": LLM(str(model_dir), max_model_len=1024, max_num_seqs=8,
                            speculative_config=spec_cfg)}
    for llm in engines.values():  # warm-up
        llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=4),
                 use_tqdm=False)
    rows = []
    kinds = [k for k in (("lookup", LOOKUP), ("open", OPEN)) if k[0] in args.kinds.split(",")]
    modes = [m == "batch" for m in ("single", "batch") if m in args.modes.split(",")]
    for kind, prompts in kinds:
        prompts = prompts[:args.prompts]
        for batch in modes:
            res = {}
            for name, llm in engines.items():
                before = dict(llm.engine.stats)
                secs, toks = run(llm, prompts, params, batch)
                d = {k: llm.engine.stats[k] - before[k] for k in llm.engine.stats}
                res[name] = (secs, toks, d)
            (t0, ref, _), (t1, got, d) = res["plain"], res["ngram"]
            n = sum(len(t) for t in ref)
            steps = d["spec_decode_num_drafts"]
            rows.append({
                "prompts": kind, "mode": "batch 8" if batch else "single stream",
                "output_tokens": n, "plain_tok_per_s": round(n / t0, 1),
                "ngram_tok_per_s": round(sum(len(t) for t in got) / t1, 1),
                "speedup": round(t0 / t1, 2),
                "acceptance_rate": round(d["spec_decode_num_accepted_tokens"]
                                         / max(1, d["spec_decode_num_draft_tokens"]), 3),
                "tokens_per_verified_step": round(
                    (d["spec_decode_num_accepted_tokens"] + steps) / steps, 2) if steps else None,
                "identical": got == ref})
            print(rows[-1], flush=True)
    print_table(rows, list(rows[0]))
    path = write_result("w7-spec", {"model": "SmolLM2-135M-Instruct (real weights, fp32)",
                                    "speculative_config": spec_cfg,
                                    "max_tokens": args.max_tokens, "rows": rows}, args.out)
    print("wrote", path)


if __name__ == "__main__":
    main()
