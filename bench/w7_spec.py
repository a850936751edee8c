"""W7: speculative decoding on the real SmolLM2-135M-Instruct (real weights).

Chat prompts of two kinds: lookup-friendly (repeat, extract from or lightly edit a quoted
text) and open-ended. Each kind runs single stream (one request at a time) and as a batch
of 8, without speculation and with each method, in this one process: output tok/s, the
speed-up, the acceptance rate (accepted / proposed drafts) and the mean tokens per
verified step. Greedy outputs are checked token for token against the plain engine's.
Each row is the median of --repeats passes, the engines taking turns.

Methods: "ngram" (prompt lookup) and "draft" (a draft model: --draft PATH, or by default
a self-draft, the target with some layers skipped (--draft-layers keeps the others), its
norm and head, written once next to the default model).
Usage: OMP_NUM_THREADS=1 python -m bench.w7_spec [--k 4] [--max-tokens 96]
       [--methods ngram,draft] [--kinds lookup,open] [--modes single,batch]
       [--temperature 0] [--device cuda] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

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


def self_draft(model_dir: Path, layers: list[int]) -> Path:
    """A model folder of the target's decoder layers `layers` (in order, renumbered), its
    final norm and its (tied) head: a draft model without training (layer skipping)."""
    import json

    from safetensors.torch import load_file, save_file

    name = "-".join(f"{a}" if a == b else f"{a}to{b}" for a, b in _runs(layers))
    out = model_dir.parent / f"{model_dir.name}-layers-{name}"
    if (out / "model.safetensors").exists():
        return out
    out.mkdir(exist_ok=True)
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["num_hidden_layers"] = len(layers)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    new_index = {old: new for new, old in enumerate(layers)}
    keep = {}
    for key, t in load_file(str(model_dir / "model.safetensors")).items():
        if key.startswith("model.layers."):
            parts = key.split(".")
            if int(parts[2]) not in new_index:
                continue
            parts[2] = str(new_index[int(parts[2])])
            key = ".".join(parts)
        keep[key] = t.contiguous()
    save_file(keep, str(out / "model.safetensors.tmp"))
    (out / "model.safetensors.tmp").rename(out / "model.safetensors")
    return out


def _runs(xs: list[int]) -> list[tuple[int, int]]:
    runs: list[list[int]] = []
    for x in xs:
        if runs and x == runs[-1][1] + 1:
            runs[-1][1] = x
        else:
            runs.append([x, x])
    return [(a, b) for a, b in runs]


def parse_layers(spec: str) -> list[int]:
    """'0-9,10-28:2,29' -> [0..9, 10, 12, ..., 28, 29] (a:b inclusive, :step)."""
    out = []
    for part in spec.split(","):
        rng, _, step = part.partition(":")
        a, _, b = rng.partition("-")
        out += range(int(a), int(b or a) + 1, int(step or 1))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--lookup-max", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--prompts", type=int, default=8, help="per kind")
    ap.add_argument("--repeats", type=int, default=3, help="passes per row (median time)")
    ap.add_argument("--methods", default="ngram,draft")
    ap.add_argument("--draft", default=None, help="draft model path (default: a self-draft)")
    ap.add_argument("--draft-layers", default="0-5,7-11,13-17,19-23,25-29",
                    help="the target's layers that the self-draft keeps")
    ap.add_argument("--kinds", default="lookup,open")
    ap.add_argument("--modes", default="single,batch")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from minivllm import LLM, SamplingParams
    from minivllm.default_model import ensure_default_model

    model_dir = ensure_default_model()
    configs = {}
    for method in args.methods.split(","):
        if method == "ngram":
            configs["ngram"] = {"method": "ngram", "num_speculative_tokens": args.k,
                                "prompt_lookup_min": 2, "prompt_lookup_max": args.lookup_max}
        elif method == "draft":
            draft = args.draft or str(self_draft(model_dir, parse_layers(args.draft_layers)))
            configs["draft"] = {"method": "draft_model", "model": draft,
                                "num_speculative_tokens": args.k}
        else:
            raise SystemExit(f"unknown method {method!r} (ngram, draft)")
    greedy = args.temperature == 0.0
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens,
                            seed=None if greedy else 0)
    # The engines share one process (and GPU): each gets its part of the memory.
    kw = dict(max_model_len=1024, max_num_seqs=8, device=args.device, dtype=args.dtype,
              gpu_memory_utilization=0.8 / (1 + len(configs)))
    engines = {"plain": LLM(str(model_dir), **kw)}
    for name, cfg in configs.items():
        engines[name] = LLM(str(model_dir), speculative_config=cfg, **kw)
    for llm in engines.values():  # warm-up
        llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=4),
                 use_tqdm=False)
    rows = []
    kinds = [k for k in (("lookup", LOOKUP), ("open", OPEN)) if k[0] in args.kinds.split(",")]
    modes = [m == "batch" for m in ("single", "batch") if m in args.modes.split(",")]
    for kind, prompts in kinds:
        prompts = prompts[:args.prompts]
        for batch in modes:
            # Each engine runs the prompts `repeats` times, taking turns: the median time
            # counts, the counters are summed over the passes, the tokens are the first's.
            times = {name: [] for name in engines}
            first = {}
            before = {name: dict(llm.engine.stats) for name, llm in engines.items()}
            for _ in range(args.repeats):
                for name, llm in engines.items():
                    secs, toks = run(llm, prompts, params, batch)
                    times[name].append(secs)
                    first.setdefault(name, toks)
            res = {name: (statistics.median(times[name]), first[name],
                          {k: llm.engine.stats[k] - before[name][k] for k in llm.engine.stats})
                   for name, llm in engines.items()}
            t0, ref, _ = res["plain"]
            n0 = sum(len(t) for t in ref)
            for name in configs:
                t1, got, d = res[name]
                n1 = sum(len(t) for t in got)
                steps = d["spec_decode_num_drafts"]
                rows.append({
                    "prompts": kind, "mode": "batch 8" if batch else "single stream",
                    "method": name, "output_tokens": n1,
                    "plain_tok_per_s": round(n0 / t0, 1), "spec_tok_per_s": round(n1 / t1, 1),
                    "speedup": round((n1 / t1) / (n0 / t0), 2),
                    "acceptance_rate": round(d["spec_decode_num_accepted_tokens"]
                                             / max(1, d["spec_decode_num_draft_tokens"]), 3),
                    "tokens_per_verified_step": round(
                        (d["spec_decode_num_accepted_tokens"] + steps) / steps, 2)
                    if steps else None,
                    # Sampled output matches in distribution only: no token check.
                    "identical": got == ref if greedy else None})
                print(rows[-1], flush=True)
    print_table(rows, list(rows[0]))
    llm = engines["plain"].engine
    path = write_result("w7-spec", {
        "model": f"SmolLM2-135M-Instruct (real weights, {str(llm.dtype).removeprefix('torch.')})",
        "device": str(llm.device), "temperature": args.temperature,
        "speculative_configs": configs, "max_tokens": args.max_tokens,
        "repeats": args.repeats, "rows": rows},
        args.out)
    print("wrote", path)


if __name__ == "__main__":
    main()
