"""minivllm against vLLM on the offline workloads, one engine per process (GPU), and the
merge of a model's run into one JSON with both engines and the ratios.

    python -m bench.vs_vllm offline --engine minivllm --model qwen2.5-0.5b-instruct --out DIR
    PYTHONPATH=$VLLM_SITE python -m bench.vs_vllm offline --engine vllm --model ... --out DIR
    python -m bench.vs_vllm merge DIR [--commit C]  # DIR/vs_vllm.json from DIR/offline_*.json + w3_*.json
    python -m bench.vs_vllm offline --engine minivllm --smoke --out DIR   # tiny, on a CPU
    python -m bench.vs_vllm offline ... --sampling greedy,sampled,top_p   # sampled decoding too

Workloads (random token ids below 10,000, ignore_eos; each repetition draws fresh prompts,
so prefix caching never serves a repeat):
  W1  256 requests, prompt and output lengths uniform in [100, 1024]: output tok/s
  W2  one request, 128-token prompt, 256 output tokens: output tok/s
  W5  32 prompts x 4096 tokens, 1 output token: prompt tok/s
  W6  64 prompts x 8192 tokens, 256 output tokens each: output tok/s (prefill included)
  SWEEP  the decode sweep (bench/workloads.py's DecodeSweep): at batch 1 to 128 with
      1,024-token prompts, ms per decode step, from a 1-token and a 257-token run (rows D1,
      D8, ...; lower is better)
Each workload runs once small first (kernels compile, graphs warm), then its repetitions;
the best repetition is the workload's number. minivllm's W6 rows also give
kv_blocks_per_seq_peak: over the run's steps, the most KV blocks in use per running sequence
(with a sliding window on every layer it stays near window / block size past the window).
Both engines get dummy bf16 weights from the same config.json (bench/model_configs/),
max_model_len 8704 (W6's 8192 + 256, rounded up to whole 16-token blocks; the models' own
32k-128k would only grow both engines' KV budgets; a model whose own context is shorter
keeps it, and a workload that would not fit is shortened for both engines: the JSON's
`shapes` say what ran, e.g. Gemma 2's W6 is 7,936-token prompts)
and otherwise their defaults. vLLM runs with skip_tokenizer_init (token-id prompts, no
detokenization: neither engine gets a tokenizer) and generation_config="vllm".
W3 (the HTTP servers) is bench/w3_gpu.py's, run beside this by bench/run_vs_vllm.sh.

Sampling (--sampling, comma-separated; default greedy): each workload but SWEEP (greedy
only) runs once per setting, greedy first. Both engines get the same SamplingParams fields
(SAMPLING below), on top of max_tokens and ignore_eos:
  greedy       temperature 0
  sampled      temperature 0.8, top_p 0.95, top_k 50, repetition_penalty 1.1, seed
  temperature  temperature 0.8, seed
  top_p        temperature 0.8, top_p 0.95, seed
  top_k        temperature 0.8, top_k 50, seed
  min_p        temperature 0.8, min_p 0.05, seed
  repetition   temperature 0, repetition_penalty 1.1
  presence     temperature 0, presence_penalty 0.5
  frequency    temperature 0, frequency_penalty 0.5
"seed" is the request's index in the workload's list (0, 1, 2, ...): the same seeds for both
engines. Greedy rows keep the workload's name (W1); the others are "W1 sampled", "W1 top_p"
and so on. A setting's run has the greedy run's prompt and output lengths with other prompt
ids (the prefix cache holds the earlier setting's prompts); so does every run of a later
round (--rounds), greedy's included.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

from bench.common import environment
from bench.gpu_check import MODELS_DIR, SMOKE_CONFIG
from bench.workloads import decode_sweep, workloads

MAX_MODEL_LEN = 8704


def max_model_len(folder: Path) -> int:
    """MAX_MODEL_LEN, or the model's own context where shorter (GPT-2's 1,024 positions:
    both engines refuse a longer max_model_len)."""
    cfg = json.loads((folder / "config.json").read_text())
    own = cfg.get("max_position_embeddings") or cfg.get("n_positions") or MAX_MODEL_LEN
    return min(MAX_MODEL_LEN, own)

# The sampling settings (--sampling): name -> SamplingParams fields (both engines take the
# same names). PER_REQUEST: the request's index in the workload's list.
PER_REQUEST = "per-request"
SAMPLING = {
    "greedy": {"temperature": 0.0},
    "sampled": {"temperature": 0.8, "top_p": 0.95, "top_k": 50, "repetition_penalty": 1.1,
                "seed": PER_REQUEST},
    "temperature": {"temperature": 0.8, "seed": PER_REQUEST},
    "top_p": {"temperature": 0.8, "top_p": 0.95, "seed": PER_REQUEST},
    "top_k": {"temperature": 0.8, "top_k": 50, "seed": PER_REQUEST},
    "min_p": {"temperature": 0.8, "min_p": 0.05, "seed": PER_REQUEST},
    "repetition": {"temperature": 0.0, "repetition_penalty": 1.1},
    "presence": {"temperature": 0.0, "presence_penalty": 0.5},
    "frequency": {"temperature": 0.0, "frequency_penalty": 0.5},
}


def sampling_fields(sampling: str, index: int) -> dict:
    """SamplingParams fields of setting `sampling` for the workload's request `index`."""
    return {k: index if v == PER_REQUEST else v for k, v in SAMPLING[sampling].items()}


def row_name(workload: str, sampling: str) -> str:
    """Greedy rows keep the workload's name (older results and the report use it)."""
    return workload if sampling == "greedy" else f"{workload} {sampling}"


# ---- engines -----------------------------------------------------------------------------------

class MinivllmEngine:
    name = "minivllm"

    def __init__(self, folder: Path, smoke: bool, quantization: str | None = None,
                 kv_cache_dtype: str = "auto", block_size: int | None = None,
                 max_graph_tokens: int | None = None,
                 max_num_batched_tokens: int | None = None,
                 parallel: dict | None = None) -> None:
        from minivllm import LLM

        kw = dict(device="cpu", dtype="float32", max_model_len=1024) if smoke else dict(
            dtype="bfloat16", max_model_len=max_model_len(folder))
        self.settings = {"load_format": "dummy", "skip_tokenizer_init": True, "seed": 0, **kw}
        if quantization:
            self.settings["quantization"] = quantization
        if block_size:
            self.settings["block_size"] = block_size
        if max_graph_tokens is not None:
            self.settings["max_graph_tokens"] = max_graph_tokens
        if max_num_batched_tokens is not None:
            self.settings["max_num_batched_tokens"] = max_num_batched_tokens
        if kv_cache_dtype != "auto":
            self.settings["kv_cache_dtype"] = kv_cache_dtype
        self.settings.update(parallel or {})
        self.llm = LLM(str(folder), **self.settings)
        # watch_kv: generate records its most KV blocks per running sequence (a read after
        # each step, so only where the number is wanted: W6).
        self.watch_kv, self.kv_blocks_per_seq = False, 0.0

    def generate(self, requests, sampling: str = "greedy") -> list[int]:
        from minivllm import SamplingParams

        params = [SamplingParams(max_tokens=o, ignore_eos=True, **sampling_fields(sampling, i))
                  for i, (_, o) in enumerate(requests)]
        prompts = [p for p, _ in requests]
        if not self.watch_kv:
            outs = self.llm.generate(prompts, params, use_tqdm=False)
            return [len(o.outputs[0].token_ids) for o in outs]
        engine = self.llm.engine
        step, self.kv_blocks_per_seq = engine.step, 0.0

        def step_watching_kv():  # two reads a step: the blocks in use, the sequences running
            out = step()
            pool, running = engine.scheduler.pool, len(engine.scheduler.running)
            if running:
                used = (pool.num_blocks - pool.num_free) / running
                self.kv_blocks_per_seq = max(self.kv_blocks_per_seq, used)
            return out

        engine.step = step_watching_kv
        try:
            outs = self.llm.generate(prompts, params, use_tqdm=False)
        finally:
            del engine.step
        return [len(o.outputs[0].token_ids) for o in outs]

    def version(self) -> str:
        import minivllm
        return minivllm.__version__


class VllmEngine:
    name = "vllm"

    def __init__(self, folder: Path, smoke: bool, quantization: str | None = None,
                 kv_cache_dtype: str = "auto", block_size: int | None = None,
                 max_graph_tokens: int | None = None,
                 max_num_batched_tokens: int | None = None,
                 parallel: dict | None = None) -> None:
        if max_graph_tokens is not None:
            raise SystemExit("--max-graph-tokens is minivllm's setting")
        if smoke:
            raise SystemExit("vLLM needs a GPU: no smoke run")
        from vllm import LLM

        self.settings = {"load_format": "dummy", "dtype": "bfloat16",
                         "max_model_len": max_model_len(folder), "skip_tokenizer_init": True,
                         "seed": 0, "generation_config": "vllm"}
        if quantization:
            self.settings["quantization"] = quantization
        if block_size:
            self.settings["block_size"] = block_size
        if max_num_batched_tokens is not None:
            self.settings["max_num_batched_tokens"] = max_num_batched_tokens
        if kv_cache_dtype != "auto":
            self.settings["kv_cache_dtype"] = kv_cache_dtype
        self.settings.update(parallel or {})
        self.llm = LLM(model=str(folder), **self.settings)

    def generate(self, requests, sampling: str = "greedy") -> list[int]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = [SamplingParams(max_tokens=o, ignore_eos=True, detokenize=False,
                                 **sampling_fields(sampling, i))
                  for i, (_, o) in enumerate(requests)]
        prompts = [TokensPrompt(prompt_token_ids=p) for p, _ in requests]
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        return [len(o.outputs[0].token_ids) for o in outs]

    def version(self) -> str:
        import vllm
        return vllm.__version__


ENGINES = {"minivllm": MinivllmEngine, "vllm": VllmEngine}


# ---- offline run -------------------------------------------------------------------------------

def model_folder(name: str, smoke: bool, work: Path) -> tuple[Path, dict]:
    """A folder holding the model's config.json (vLLM takes folders only)."""
    cfg = dict(SMOKE_CONFIG) if smoke else json.loads((MODELS_DIR / f"{name}.json").read_text())
    folder = work / ("smoke" if smoke else name)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    return folder, cfg


def sync() -> None:
    import torch
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(engine, reqs, sampling: str = "greedy") -> float:
    """Seconds for one generate call of `reqs`, each output checked to be its max_tokens."""
    sync()
    start = time.perf_counter()
    got = engine.generate(reqs, sampling)
    sync()
    secs = time.perf_counter() - start
    want = [o for _, o in reqs]
    if got != want:
        raise RuntimeError(f"output lengths differ from max_tokens ({sum(got)} vs "
                           f"{sum(want)} tokens)")
    return secs


def with_sampling(reqs, w, key: str, sampling: str, round_: int = 0):
    """Greedy in the first round: `reqs` as they are. Another setting or round: the same
    prompt and output lengths with other prompt ids, so its run's shapes are the greedy
    run's but no prompt is one the prefix cache holds from an earlier run."""
    if sampling == "greedy" and round_ == 0:
        return reqs
    rng = random.Random(f"{key}-{sampling}" + (f"-round{round_}" if round_ else ""))
    return [([rng.randrange(10, w.vocab) for _ in p], o) for p, o in reqs]


def sampling_settings(text: str) -> list[str]:
    names = list(dict.fromkeys(s.strip().lower() for s in text.split(",") if s.strip()))
    unknown = [s for s in names if s not in SAMPLING]
    if unknown or not names:
        raise SystemExit(f"--sampling: unknown setting(s) {', '.join(unknown) or '(none)'}; "
                         f"known: {', '.join(SAMPLING)}")
    return sorted(names, key=lambda s: s != "greedy")  # greedy first, the rest as given


def run_offline(args) -> int:
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    # A quantized run's file and rows carry its method ("fp8", "kv-fp8", "fp8+kv-fp8").
    label = "+".join(([args.quantization] if args.quantization else [])
                     + ([f"kv-{args.kv_cache_dtype}"] if args.kv_cache_dtype != "auto" else [])
                     + ([f"block{args.block_size}"] if args.block_size else [])
                     + ([f"graphs{args.max_graph_tokens}"]
                        if args.max_graph_tokens is not None else [])
                     + ([f"step{args.max_num_batched_tokens}"]
                        if args.max_num_batched_tokens is not None else [])
                     + [f"{k}{v}" for k, v in (("tp", args.tensor_parallel_size),
                                                ("dp", args.data_parallel_size)) if v > 1])
    parallel = {k: v for k, v in (("tensor_parallel_size", args.tensor_parallel_size),
                                  ("data_parallel_size", args.data_parallel_size)) if v > 1}
    suffix = f"_{label}" if label else ""
    path = out_dir / f"offline_{args.engine}{suffix}.json"
    folder, cfg = model_folder(args.model, args.smoke, Path(args.work))
    # A model with a shorter context than a workload needs gets that workload shortened,
    # the same for both engines (bench.workloads.fit_context; the record's "shapes").
    wl = workloads(args.smoke, cfg["vocab_size"], None if args.smoke else max_model_len(folder))
    chosen = [w.strip().upper() for w in args.workloads.split(",") if w.strip()]
    settings = sampling_settings(args.sampling)
    record = {"benchmark": "vs_vllm_offline", "engine": args.engine, "model": args.model,
              "environment": environment(), "sampling": {s: SAMPLING[s] for s in settings},
              "shapes": {n: {"requests": w.n, "prompt": list(w.prompt),
                             "output": list(w.output)} for n, w in wl.items()},
              "rows": [], "best": {}}

    def save() -> None:
        path.write_text(json.dumps(record, indent=1))

    t0 = time.perf_counter()
    engine = ENGINES[args.engine](folder, args.smoke, args.quantization, args.kv_cache_dtype,
                                  args.block_size, args.max_graph_tokens,
                                  args.max_num_batched_tokens, parallel)
    record.update(startup_s=round(time.perf_counter() - t0, 1), settings=engine.settings,
                  version=engine.version())
    log(f"{args.engine} {args.model}: engine ready in {record['startup_s']} s")
    save()
    for name in chosen:
        if hasattr(engine, "watch_kv"):
            engine.watch_kv = name == "W6"  # the long run past a window
        if name == "SWEEP":
            run_decode_sweep(engine, decode_sweep(args.smoke, cfg["vocab_size"]), record,
                             args, save)
            continue
        w = wl[name]
        if args.rounds > 1:
            # One untimed full-size run first (prompts no timed run has): round 0's greedy,
            # the call's first full-size run, ran 20% under round 1's in a call where every
            # other setting gained 10-12% (2026-12-05-h100-sampler-min-p-graph).
            engine.generate(with_sampling(w.requests(0), w, f"{w.name}-warm-full", settings[0],
                                          round_=-1), settings[0])
        for round_ in range(args.rounds):
            for sampling in settings:
                run_workload(engine, w, sampling, record, args, save, round_)
    log(f"wrote {path}")
    return 1 if record.get("errors") else 0


def run_workload(engine, w, sampling: str, record: dict, args, save, round_: int = 0) -> None:
    """One workload under one sampling setting: a warm-up (in the first round), then its
    repetitions (rows row_name(workload, sampling)), the best of every round's in
    record["best"]."""
    name = row_name(w.name, sampling)
    try:
        if round_ == 0:
            engine.generate(with_sampling(w.warm_up(), w, f"{w.name}-warm", sampling),
                            sampling)
        for rep in range(w.reps):
            reqs = with_sampling(w.requests(rep), w, f"{w.name}-{rep}", sampling, round_)
            secs = _timed(engine, reqs, sampling)
            prompt_tokens = sum(len(p) for p, _ in reqs)
            output_tokens = sum(o for _, o in reqs)
            row = {"workload": name, "rep": rep, "sampling": sampling,
                   "seconds": round(secs, 4), "requests": len(reqs),
                   "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
                   "output_tok_per_s": round(output_tokens / secs, 1),
                   "prompt_tok_per_s": round(prompt_tokens / secs, 1)}
            if getattr(engine, "watch_kv", False):  # with a sliding window: flat past it
                row["kv_blocks_per_seq_peak"] = round(engine.kv_blocks_per_seq, 1)
            if args.rounds > 1:
                row["round"] = round_
            record["rows"].append(row)
            log(f"{args.engine} {args.model} {name} rep {rep}: {row[w.metric]:,.0f} "
                f"{w.metric} ({secs:.2f} s)")
            save()
        rows = [r for r in record["rows"] if r["workload"] == name]
        record["best"][name] = {"metric": w.metric, "value": max(r[w.metric] for r in rows)}
    except Exception as e:  # noqa: BLE001 - keep the other workloads' numbers
        record.setdefault("errors", {})[name] = f"{type(e).__name__}: {e}"[:2000]
        log(f"{args.engine} {args.model} {name} failed: {e}")
    save()


def run_decode_sweep(engine, sweep, record: dict, args, save) -> None:
    """Rows D<batch>: ms per decode step, the long run's time less the short one's over
    the steps between them (bench/workloads.py's DecodeSweep)."""
    for batch in sweep.batches:
        name = f"D{batch}"
        try:
            for run in sweep.runs(batch, -1):  # warm-up: this batch's shapes
                engine.generate(run.requests(0))
            for rep in range(sweep.reps):
                short, long = sweep.runs(batch, rep)
                short_s = _timed(engine, short.requests(0))
                long_s = _timed(engine, long.requests(0))
                row = {"workload": name, "rep": rep, "batch": batch,
                       "prompt_tokens_each": sweep.prompt, "steps": sweep.steps,
                       "short_s": round(short_s, 4), "long_s": round(long_s, 4),
                       "decode_ms_per_step": round(1000 * (long_s - short_s) / sweep.steps, 3)}
                record["rows"].append(row)
                log(f"{args.engine} {args.model} {name} rep {rep}: "
                    f"{row['decode_ms_per_step']} ms a decode step")
                save()
            record["best"][name] = {"metric": "decode_ms_per_step", "value": min(
                r["decode_ms_per_step"] for r in record["rows"] if r["workload"] == name)}
        except Exception as e:  # noqa: BLE001 - keep the other batches' numbers
            record.setdefault("errors", {})[name] = f"{type(e).__name__}: {e}"[:2000]
            log(f"{args.engine} {args.model} {name} failed: {e}")
        save()


# ---- merge -------------------------------------------------------------------------------------

# The W3 files' label suffixes: plain, and bench/w3_gpu.py --generation-config-json's.
# run_vs_vllm.sh's W3_GENCONFIG (with W3_ARGS="--client-temperature unset": -sampled too), VS_TP,
# VS_DP
W3_VARIANTS = ("", "-genconfig", "-genconfig-sampled", "-tp2", "-dp2")
W3_METRICS = (("output_tok_per_s", "tok/s", True), ("itl_ms_p99", "ITL p99 ms", False),
              ("ttft_ms_p99", "TTFT p99 ms", False), ("tokens_per_event", "tok/chunk", False))


def _w3_levels(path: Path) -> dict[int, dict]:
    if not path.exists():
        return {}
    data = json.loads(path.read_text())
    levels = {}
    for t in data.get("targets", []):
        for lv in t.get("levels", []):
            if lv.get("output_tok_per_s"):
                levels[lv["concurrency"]] = lv
    return levels


def _same_commit(a: str | None, b: str) -> bool:
    """Whether two commits (full or short hashes, "-dirty" or not) name the same one."""
    return bool(a) and a.strip()[:7] == b.strip()[:7]


def merge(folder: Path, commit: str | None = None) -> dict:
    """One model's run (both engines, every workload) as one JSON: each table row with
    both engines' numbers and minivllm's ratio (higher is better for minivllm: for
    latencies the ratio is vLLM's over minivllm's). With `commit`, files another commit's
    run left in the folder (a lent machine's /tmp keeps earlier borrowers' files) are left
    out, and said."""
    kept: dict[Path, dict | None] = {}

    def read(p: Path) -> dict | None:
        if p not in kept:
            d = json.loads(p.read_text()) if p.exists() else None
            ran = d and (d.get("environment") or {}).get("git_commit")
            if d is not None and commit and not _same_commit(ran, commit):
                log(f"merge: {p.name} left out (commit {ran}, this run's {commit[:7]})")
                d = None
            kept[p] = d
        return kept[p]

    # offline_ENGINE.json, and offline_ENGINE_METHOD.json for a quantized run (its rows are
    # labelled "W1 fp8" and so on).
    methods = sorted({p.stem.split("_", 2)[2] for p in folder.glob("offline_*_*.json")
                      if read(p) is not None})
    rows, model, runs = [], None, {}
    for method in [""] + methods:
        engines = runs[method] = {}
        for name in ENGINES:
            engines[name] = read(folder / f"offline_{name}{'_' + method if method else ''}.json")
        model = model or next((e["model"] for e in engines.values() if e), None)
        sweep = sorted({k for e in engines.values() if e for k in e.get("best", {})
                        if k.startswith("D")}, key=lambda k: int(k[1:]))
        # Each workload's greedy row, then its other sampling settings' ("W1 sampled").
        names = [row_name(w, s) for w in ("W1", "W2", "W5", "W6") for s in SAMPLING]
        for wname in names + sweep:
            vals = {k: (e or {}).get("best", {}).get(wname) for k, e in engines.items()}
            metric = next((v["metric"] for v in vals.values() if v), None)
            if metric is None:
                continue
            mine, theirs = ((vals[k] or {}).get("value") for k in ("minivllm", "vllm"))
            ratio = None
            if mine and theirs:  # above 1: minivllm better (a step's time: lower is)
                ratio = round(theirs / mine if metric == "decode_ms_per_step"
                              else mine / theirs, 3)
            rows.append({"workload": f"{wname} {method}".strip(), "metric": metric,
                         "minivllm": mine, "vllm": theirs, "ratio": ratio})
    model = model or folder.name
    # w3_ENGINE.json, and w3_ENGINE-genconfig.json for servers that read the model's
    # generation_config.json (bench/w3_gpu.py --generation-config-json): rows "W3 c=64",
    # "W3 genconfig c=64".
    w3_env = {}
    for variant in W3_VARIANTS:
        w3 = {k: _w3_levels(folder / f"w3_{k}{variant}.json")
              if read(folder / f"w3_{k}{variant}.json") else {} for k in ENGINES}
        tag = " ".join(["W3"] + ([variant.lstrip("-")] if variant else []))
        for c in sorted(set(w3["minivllm"]) | set(w3["vllm"])):
            for key, label, higher in W3_METRICS:
                mine = w3["minivllm"].get(c, {}).get(key)
                theirs = w3["vllm"].get(c, {}).get(key)
                ratio = None
                if mine and theirs:
                    ratio = round(mine / theirs if higher else theirs / mine, 3)
                rows.append({"workload": f"{tag} c={c}", "metric": key, "label": label,
                             "minivllm": mine, "vllm": theirs,
                             "ratio": ratio if key != "tokens_per_event" else None})
        for k in ENGINES:
            d = read(folder / f"w3_{k}{variant}.json")
            if d is not None:
                w3_env[k + variant] = {
                    "environment": d.get("environment"), "workload": d.get("workload"),
                    "launch_cmd": next((t.get("launch_cmd") for t in d.get("targets", [])),
                                       None)}
    env = next((e["environment"] for r in runs.values() for e in r.values() if e), None) \
        or next((v["environment"] for v in w3_env.values() if v.get("environment")), {})

    def summary(engines):
        return {k: e and {x: e.get(x) for x in ("engine", "version", "settings", "startup_s",
                                                "environment", "sampling", "rows", "errors")}
                for k, e in engines.items()}

    result = {"benchmark": "vs_vllm", "model": model, "environment": env, "rows": rows,
              "offline": summary(runs[""]),
              "offline_quantized": {m: summary(runs[m]) for m in methods},
              "w3": w3_env}
    (folder / "vs_vllm.json").write_text(json.dumps(result, indent=1))
    return result


def log(*a) -> None:
    print("[vs_vllm]", *a, flush=True, file=sys.stderr)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    sub = p.add_subparsers(dest="cmd", required=True)
    off = sub.add_parser("offline", help="one engine's offline workloads")
    off.add_argument("--engine", choices=sorted(ENGINES), required=True)
    off.add_argument("--model", default="qwen2.5-0.5b-instruct",
                     help="a config under bench/model_configs/ (without .json)")
    off.add_argument("--workloads", default="w1,w2,w5,w6",
                     help="comma-separated: w1, w2, w5, w6, sweep (the decode sweep)")
    off.add_argument("--sampling", default="greedy",
                     help="comma-separated sampling settings, each workload (but sweep) run "
                          f"once per setting, greedy first: {', '.join(SAMPLING)}; rows of "
                          "a setting other than greedy are \"W1 sampled\" and so on")
    off.add_argument("--rounds", type=int, default=1,
                     help="run each workload's settings this many times over, in turn "
                          "(greedy, sampled, ..., greedy, sampled, ...): a drift in the "
                          "GPU's speed then reaches every setting alike; each round's "
                          "prompts are fresh (the prefix cache serves none), and one "
                          "untimed full-size run comes before the first round")
    off.add_argument("--out", required=True, help="the run's folder")
    off.add_argument("--work", default="/tmp/minivllm-vs-vllm", help="model folders")
    off.add_argument("--smoke", action="store_true", help="a tiny model on the CPU")
    off.add_argument("--quantization", default=None,
                     help="both engines' quantization (fp8; minivllm also int8, int4); "
                          "its file is offline_ENGINE_METHOD.json")
    off.add_argument("--kv-cache-dtype", default="auto",
                     help="both engines' KV cache dtype (auto or fp8); with it the file is "
                          "offline_ENGINE_kv-fp8.json (or _METHOD+kv-fp8)")
    off.add_argument("--block-size", type=int, default=None,
                     help="the KV cache's tokens per block (default: the engine's); with it "
                          "the file is offline_ENGINE_blockN.json")
    off.add_argument("--max-graph-tokens", type=int, default=None,
                     help="minivllm's largest prefill/mixed-step graph (default: its own); "
                          "with it the file is offline_minivllm_graphsN.json")
    off.add_argument("--tensor-parallel-size", type=int, default=1,
                     help="both engines' tensor_parallel_size; above 1 the file is "
                          "offline_ENGINE_tpN.json")
    off.add_argument("--data-parallel-size", type=int, default=1,
                     help="both engines' data_parallel_size; above 1 the file is "
                          "offline_ENGINE_dpN.json")
    off.add_argument("--max-num-batched-tokens", type=int, default=None,
                     help="the engine's token budget per step (default: its own; vLLM's "
                          "offline LLM takes 16,384 on an H200, minivllm 8,192); with it "
                          "the file is offline_ENGINE_stepN.json")
    mg = sub.add_parser("merge", help="DIR/vs_vllm.json from the run's files")
    mg.add_argument("folder")
    mg.add_argument("--commit", default=None,
                    help="only files of this commit's runs (others are left out, and said)")
    args = p.parse_args(argv)
    if args.cmd == "merge":
        res = merge(Path(args.folder), args.commit)
        for r in res["rows"]:
            log(f"{r['workload']:10s} {r['metric']:18s} minivllm {r['minivllm']} vllm "
                f"{r['vllm']} ratio {r['ratio']}")
        return 0
    return run_offline(args)


if __name__ == "__main__":
    raise SystemExit(main())
