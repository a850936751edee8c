"""W8: structured outputs offline, one engine per process (run it once per engine in the
same device call, then compare the JSON files).

    256 requests with a json_schema (four distinct schemas, xgrammar in both engines) and
    256 unconstrained, same prompts and output budget (max_tokens 128, ignore_eos), dummy
    bf16 weights from a config.json, a real tokenizer folder (the Qwen2.5 one on the GPU
    machine: bench/run_vs_vllm.sh's bundle puts it in /tmp/qwen25).

Rows: "unconstrained", "constrained", "mixed" (both halves in one batch): output tok/s,
best of --reps; "ttft cached schema" and "ttft unconstrained": one request alone for one
token, start to finish, median of 9 after a warm-up that compiled the schema. A constrained row's output may end before max_tokens (its grammar completes);
its tokens are what is counted. TTFT here is a one-token request's whole time, alone.

    python -m bench.w8_structured --engine minivllm --config bench/model_configs/X.json \\
        --tokenizer /tmp/qwen25 --out results/w8-minivllm.json
    python -m bench.w8_structured --engine minivllm --smoke --out /tmp/w8.json  (CPU)
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

SCHEMAS = [
    {"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"},
        "email": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14}},
     "required": ["city", "unit", "days"], "additionalProperties": False},
    {"type": "object", "properties": {
        "title": {"type": "string"}, "rating": {"type": "number"},
        "review": {"type": "object", "properties": {"pros": {"type": "array", "items": {
            "type": "string"}}, "cons": {"type": "array", "items": {"type": "string"}}},
            "required": ["pros", "cons"]}},
     "required": ["title", "rating", "review"], "additionalProperties": False},
    {"type": "object", "properties": {
        "steps": {"type": "array", "items": {"type": "object", "properties": {
            "action": {"type": "string"}, "done": {"type": "boolean"}},
            "required": ["action", "done"]}}, "summary": {"type": "string"}},
     "required": ["steps"], "additionalProperties": False},
]
PROMPTS = ["Describe a person as JSON.", "What is the weather forecast? Answer in JSON.",
           "Review the last film you saw, as JSON.", "Plan a picnic in JSON steps."]


def requests(n: int, max_tokens: int):
    """(prompt, schema or None) for n constrained and n unconstrained requests."""
    out = []
    for i in range(n):
        out.append((f"{PROMPTS[i % 4]} (request {i})", SCHEMAS[i % 4]))
    for i in range(n):
        out.append((f"{PROMPTS[i % 4]} (request {n + i})", None))
    return out


def model_folder(config: Path | None, tokenizer: Path | None, smoke: bool) -> Path:
    folder = Path(tempfile.mkdtemp(prefix="w8-"))
    if smoke:
        from minivllm.server.testing import make_tiny_chat_model
        return make_tiny_chat_model(folder)
    shutil.copy(config, folder / "config.json")
    for f in tokenizer.iterdir():
        if f.is_file() and f.name != "config.json":
            shutil.copy(f, folder / f.name)
    return folder


NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
         "prompt_lookup_max": 4}


class Engine:
    """What the two engines share: their offline APIs take the same names."""

    llm = None

    def host_times(self) -> dict:
        return {}

    def classes(self):
        """(SamplingParams, StructuredOutputsParams) of this engine."""
        raise NotImplementedError

    def params(self, schema, max_tokens: int):
        sampling, structured = self.classes()
        so = structured(json=schema) if schema is not None else None
        return sampling(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                        structured_outputs=so)

    def generate(self, reqs, max_tokens: int) -> int:
        outs = self.llm.generate([p for p, _ in reqs],
                                 [self.params(s, max_tokens) for _, s in reqs], use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs)

    def ttft(self, prompt: str, schema) -> float:
        """A one-token request alone, start to finish (the same measure for both: vLLM's
        offline API has no step loop to watch for the first token)."""
        start = time.perf_counter()
        self.llm.generate([prompt], [self.params(schema, 1)], use_tqdm=False)
        return time.perf_counter() - start


class Minivllm(Engine):
    def __init__(self, folder: Path, smoke: bool, speculative: bool = False) -> None:
        from minivllm import LLM
        kw = dict(device="cpu", dtype="float32", max_model_len=512) if smoke else dict(
            dtype="bfloat16", max_model_len=2048)
        if speculative:  # the stretch: a grammar's forced text proposed as drafts
            kw["speculative_config"] = NGRAM
        self.llm = LLM(str(folder), load_format="dummy", seed=0, **kw)
        # The host's share of a step: the grammar hook (matchers advanced, bitmasks filled)
        # runs while the step's model graph does; timed, it says whether it still hides.
        self.hook_s, self.hook_calls = 0.0, 0
        sampler = self.llm.llm_engine.runner.sampler
        hook = sampler.before_sample

        def timed(*args):
            start = time.perf_counter()
            try:
                return hook(*args)
            finally:
                self.hook_s += time.perf_counter() - start
                self.hook_calls += 1
        sampler.before_sample = timed

    def classes(self):
        from minivllm import SamplingParams, StructuredOutputsParams
        return SamplingParams, StructuredOutputsParams

    def host_times(self) -> dict:
        """The grammar hook's time since the last call: per sampling step, and in all."""
        out = {"grammar_hook_ms_per_step": 1000 * self.hook_s / max(self.hook_calls, 1),
               "grammar_hook_s": self.hook_s, "sampling_steps": self.hook_calls}
        self.hook_s, self.hook_calls = 0.0, 0
        return out


class Vllm(Engine):
    def __init__(self, folder: Path, smoke: bool, speculative: bool = False) -> None:
        if smoke:
            raise SystemExit("vLLM needs a GPU")
        from vllm import LLM
        kw = {"speculative_config": NGRAM} if speculative else {}
        self.llm = LLM(model=str(folder), load_format="dummy", dtype="bfloat16",
                       max_model_len=2048, seed=0, generation_config="vllm", **kw)

    def classes(self):
        from vllm import SamplingParams
        from vllm.sampling_params import StructuredOutputsParams
        return SamplingParams, StructuredOutputsParams


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", choices=["minivllm", "vllm"], required=True)
    ap.add_argument("--config", type=Path)
    ap.add_argument("--tokenizer", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--smoke", action="store_true", help="a tiny model on the CPU")
    ap.add_argument("--speculative", action="store_true",
                    help="n-gram speculation in both engines (minivllm then also drafts "
                         "the text a grammar forces)")
    args = ap.parse_args(argv)
    n, max_tokens = (8, 16) if args.smoke else (args.n, args.max_tokens)
    folder = model_folder(args.config, args.tokenizer, args.smoke)
    engine = (Minivllm if args.engine == "minivllm" else Vllm)(folder, args.smoke,
                                                                args.speculative)
    reqs = requests(n, max_tokens)
    engine.generate(reqs[:4] + reqs[n:n + 4], 8)  # warm up; compiles two schemas
    engine.generate([(p, s) for p, s in reqs[:4]], 4)  # and the other two
    rows = {}
    for name, part in (("constrained", reqs[:n]), ("unconstrained", reqs[n:]),
                       ("mixed", reqs)):
        best = None
        for _ in range(args.reps):
            engine.host_times()
            start = time.perf_counter()
            tokens = engine.generate(part, max_tokens)
            secs = time.perf_counter() - start
            if best is None or tokens / secs > best["output_tok_per_s"]:
                best = {"output_tok_per_s": tokens / secs, "tokens": tokens, "seconds": secs,
                        **engine.host_times()}
        rows[name] = best
        print(name, f"{best['output_tok_per_s']:.0f} tok/s", file=sys.stderr)
    for name, schema in (("ttft cached schema", SCHEMAS[1]), ("ttft unconstrained", None)):
        engine.ttft(PROMPTS[1], schema)
        rows[name] = {"seconds": statistics.median(engine.ttft(PROMPTS[1], schema)
                                                   for _ in range(9))}
    rows["constrained / unconstrained"] = (rows["constrained"]["output_tok_per_s"]
                                           / rows["unconstrained"]["output_tok_per_s"])
    rows["cached schema ttft extra ms"] = 1000 * (rows["ttft cached schema"]["seconds"]
                                                  - rows["ttft unconstrained"]["seconds"])
    record = {"engine": args.engine, "config": str(args.config), "n": n,
              "speculative": args.speculative,
              "max_tokens": max_tokens, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1))
    print(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
