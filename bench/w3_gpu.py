"""W3 serving on the H200, budgeted: minivllm's server (concurrency sweep, then a ramp for the
largest concurrency held without a failed request), the offline engine on the same requests,
`transformers serve` (continuous batching, and plain) and vLLM's OpenAI server (from the
bundle of ../shared/gpu/vllm-bundle.sh) through the same HTTP client.

Each part runs in its own process, writes one JSON (serve_bench's format: bench/report.py
and bench/serve_report.py read it) and rewrites it after every concurrency level, so a time
limit or a crash keeps what was measured. Every part watches its own --budget-s: a level
that would not fit is shrunk to one round, or skipped and marked so.

    python -m bench.w3_gpu prepare      --work /tmp/w3 [--hf-weights]
    python -m bench.w3_gpu minivllm     --work /tmp/w3 --out-dir DIR --budget-s 170
    python -m bench.w3_gpu offline      --work /tmp/w3 --out-dir DIR --budget-s 110
    python -m bench.w3_gpu transformers --work /tmp/w3 --out-dir DIR --budget-s 170 [--plain]
    python -m bench.w3_gpu vllm         --work /tmp/w3 --out-dir DIR --budget-s 170  # $VLLM_SITE
    add --smoke to any of them: a tiny Qwen2 config on the CPU, tiny sizes (checks the plumbing)

Requests: prompts of --prompt-tokens tokens (random, seeded; a fresh prompt for every request
of a part, since minivllm caches prefixes; level c gets the same prompts in every part),
--output-tokens forced (minivllm: ignore_eos; transformers: min_new_tokens), greedy,
streamed. There are no real
weights or tokenizer on the GPU machine, and transformers serve only takes text, so
`prepare` writes, next to the config, a byte-level tokenizer without merges: a prompt of N
ASCII characters is exactly N tokens (id = byte) for every server, the offline engine gets
those very ids, and every other id the dummy model samples decodes to a word " t<id>", so
streamed chunks carry text the client can time. (--prompt-mode tokens sends minivllm the ids
with --skip-tokenizer-init instead: its chunks then carry no text.)

Sampling: of the sampling fields the client sends only temperature 0 (greedy; another with
--client-temperature, none with --client-temperature unset), max_tokens and ignore_eos; by
default no server has sampling defaults (the model folder holds no
generation_config.json and vLLM runs with --generation-config vllm).
--generation-config-json PATH (minivllm and vllm parts, and prepare without --hf-weights)
copies PATH into the model folder as generation_config.json and starts both servers with
their default (auto), so each reads it as a model's own: the fields the client leaves unset
(top_p, top_k, repetition_penalty, ...) come from it, as on a user's server. Those parts'
labels and files then end in -genconfig (w3_minivllm-genconfig.json), and the file's content
is the result's workload.generation_config (null without it). With --client-temperature
unset as well, the file's temperature applies too (requests sampled as a user's would be
who sends none): labels end in -genconfig-sampled.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

from bench import proc_cpu
from bench import serve_bench as sb

REPO = Path(__file__).resolve().parent.parent
DEFAULT_MODEL_CONFIG = REPO / "bench" / "model_configs" / "qwen2.5-0.5b-instruct.json"
DEFAULT_CONCURRENCY = [1, 8, 32, 64, 128, 256]
DEFAULT_RAMP = [384, 512, 768, 1024]
# Every target measures concurrency 64 first: it is the level of the "server within 20% of
# the offline engine" target and of the peer ratios, so a time limit cannot cost it, and a
# slow peer's budget is not spent on low concurrencies first (whose rate, taken as the
# estimate for the next level, would skip the rest).
FIRST_LEVEL = 64
# The warm-up ends with a burst of this many requests at once (capped by the part's largest
# level), 8 output tokens each: prefills of that size compile their Triton kernels there,
# not in the first measured level (on a fresh H200 the first c=64 level had a 495 ms mean
# server TTFT after an 8-request warm-up).
WARM_BURST = 64

from bench.gpu_check import SMOKE_CONFIG  # noqa: E402  (the same tiny model)

STOP_RESERVE_S = 15  # kept back from a part's budget to stop its server and write the JSON
GENCONFIG_LABEL = "-genconfig"  # the label suffix of parts run with --generation-config-json
SAMPLED_LABEL = "-sampled"  # and of parts whose client sends no temperature
GENERATION_CONFIG = "generation_config.json"


def log(*a) -> None:
    print("[w3_gpu]", *a, flush=True)


# ---- the model folder: config.json, word-level tokenizer, optional HF weights ----------------

def _smoke_model(args) -> bool:
    """--smoke without a --model-config of its own: the tiny model."""
    return args.smoke and args.model_config == str(DEFAULT_MODEL_CONFIG)


def model_config(args) -> dict:
    if _smoke_model(args):
        return dict(SMOKE_CONFIG)
    return json.loads(Path(args.model_config).read_text())


def model_name(args) -> str:
    return "smoke-qwen2" if _smoke_model(args) else Path(args.model_config).stem


def model_dir(args, hf_weights: bool) -> Path:
    """minivllm's folder (config.json + tokenizer: dummy weights) or transformers' (+ weights)."""
    name = f"{model_name(args)}-dummy" + ("-real-tokenizer" if args.tokenizer_dir else "")
    return Path(args.work) / ("hf" if hf_weights else "minivllm") / name


# A byte-level BPE with no merges: token id b < 256 is byte b, so ASCII text of N characters
# is exactly N tokens (the ids are the bytes), and every other id is a filler word that
# decodes to " t<id>". It is built exactly as transformers' Qwen2Tokenizer builds itself
# from a tokenizer.json (same pre-tokenizer, decoder, normalizer), so AutoTokenizer gives
# the same ids whether it picks Qwen2Tokenizer (a folder whose config.json says qwen2, as in
# transformers 5.17 and 5.24) or the generic backend.
_QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"""
                r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
PROMPT_CHARS = "abcdefghijklmnopqrstuvwxyz0123456789"


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte -> printable character table (ByteLevel's alphabet)."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1))
          + list(range(ord("\xae"), ord("\xff") + 1)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def write_tokenizer(folder: Path, vocab_size: int) -> None:
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 257:
        raise ValueError(f"vocab_size {vocab_size} < 257: no room for the byte tokens")
    chars = _byte_chars()
    vocab = {chars[b]: b for b in range(256)}
    vocab.update({f"\u0120t{i}": i for i in range(256, vocab_size)})  # \u0120 = ByteLevel space
    tok = Tokenizer(BPE(vocab=vocab, merges=[], dropout=None, unk_token=None,
                        continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False,
                        byte_fallback=False))
    tok.decoder = decoders.ByteLevel()
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(folder)


def prepare(args, hf_weights: bool) -> Path:
    """The model folder transformers serve loads: config, tokenizer and (with hf_weights)
    random bf16 weights written by transformers itself."""
    folder = model_dir(args, hf_weights)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = model_config(args)
    if hf_weights and not any(folder.glob("*.safetensors")):
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        t0 = time.perf_counter()
        hf_cfg = AutoConfig.for_model(cfg["model_type"], **{k: v for k, v in cfg.items()
                                                             if k != "model_type"})
        device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
        dtype = torch.float32 if args.smoke else torch.bfloat16
        torch.manual_seed(0)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype)
        model.save_pretrained(folder)
        del model
        log(f"wrote random {dtype} weights to {folder} in {time.perf_counter() - t0:.1f}s")
    if not (folder / "config.json").exists():
        (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    if args.tokenizer_dir and not (folder / "tokenizer.json").exists():
        for f in Path(args.tokenizer_dir).iterdir():  # a real tokenizer (W8 --structured)
            if f.is_file() and f.name not in ("config.json", GENERATION_CONFIG):
                shutil.copyfile(f, folder / f.name)
    if not (folder / "tokenizer.json").exists():
        write_tokenizer(folder, cfg["vocab_size"])
    if not hf_weights:  # the servers' folder: minivllm's reads a generation_config.json there
        if args.generation_config_json:
            shutil.copyfile(args.generation_config_json, folder / GENERATION_CONFIG)
        else:  # an earlier run's copy (the same --work) would give minivllm defaults
            (folder / GENERATION_CONFIG).unlink(missing_ok=True)
    return folder


# ---- requests ---------------------------------------------------------------------------------

def text_prompts(args, count: int, seed: int) -> list[str]:
    """`count` prompts of --prompt-tokens characters; prompt i is the same whatever the count."""
    rng = random.Random(seed)
    return ["".join(rng.choice(PROMPT_CHARS) for _ in range(args.prompt_tokens))
            for _ in range(count)]


class Prompts:
    """Every request of a part gets a prompt of its own (minivllm caches prefixes: a prompt
    seen before would skip its prefill), and level c gets the same prompts in every part:
    slices of one seeded pool, laid out over all the levels any part measures. Warm-up
    prompts come from another seed. As token ids (the offline engine; minivllm with
    --prompt-mode tokens) the tokenizer above maps character = byte = token id."""

    def __init__(self, args, as_tokens: bool) -> None:
        levels = sorted(set(args.concurrency) | set(args.ramp) | set(args.plain_concurrency))
        self.offsets, total = {}, 0
        for c in levels:
            self.offsets[c] = total
            total += max(requests_at(args, c), c)
        conv = (lambda ps: [list(p.encode("ascii")) for p in ps]) if as_tokens else list
        self.pool = conv(text_prompts(args, total, args.seed))
        self.warm = conv(text_prompts(args, 2 + WARM_BURST, args.seed + 1))

    def at(self, c: int) -> list:
        return self.pool[self.offsets[c]:self._end(c)]

    def _end(self, c: int) -> int:
        later = [o for o in self.offsets.values() if o > self.offsets[c]]
        return min(later) if later else len(self.pool)


def generation_config(args) -> dict | None:
    """The generation_config.json both servers read (--generation-config-json), or None."""
    if not args.generation_config_json:
        return None
    return json.loads(Path(args.generation_config_json).read_text())


def requests_at(args, c: int) -> int:
    return max(args.min_requests, int(round(args.rounds * c)))


def workload(args) -> dict:
    return {"prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens,
            "concurrency": args.concurrency, "rounds": args.rounds,
            "min_requests": args.min_requests, "prompt_mode": args.prompt_mode,
            "seed": args.seed,
            "prompt_chars": PROMPT_CHARS, "temperature": args.client_temperature,
            "stream": True,
            "generation_config": generation_config(args),
            "endpoint": "/v1/completions",
            "model": model_name(args), "model_config": model_config(args),
            "weights": "dummy (random)", "dtype": "float32" if args.smoke else "bfloat16"}


class Recorder:
    """One result file, rewritten (atomically) whenever something new is measured."""

    def __init__(self, path: Path, args, part: str) -> None:
        self.path = path
        self.payload = {"benchmark": "w3_serve", "part": part, "environment": sb.environment(),
                        "workload": workload(args), "budget_s": args.budget_s,
                        "targets": []}
        path.parent.mkdir(parents=True, exist_ok=True)

    def target(self, **fields) -> dict:
        t = {"levels": [], **fields}
        self.payload["targets"].append(t)
        self.save()
        return t

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.payload, indent=2))
        os.replace(tmp, self.path)


class Budget:
    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds

    def left(self) -> float:
        return self.deadline - time.monotonic() - STOP_RESERVE_S


def plan_level(c: int, n: int, out_tokens: int, last_tok_s: float | None,
               left: float) -> tuple[int | None, str | None]:
    """Requests to send at concurrency c in the time left: n, one round (c), or None."""
    if left <= 5:
        return None, "time budget spent"
    if last_tok_s is None:
        return n, None
    # Throughput grows with concurrency, so the last level's rate overestimates the time.
    for k in (n, c):
        if 1.2 * k * out_tokens / last_tok_s + 3 < left:
            return k, None
    return None, f"would not fit in the {left:.0f}s left (est. at {last_tok_s:.0f} tok/s)"


# ---- HTTP parts -------------------------------------------------------------------------------

def server_args(args) -> list[str]:
    """The engine flags every server here gets (minivllm's and vLLM's have the same names)."""
    base = ["--model", str(prepare(args, hf_weights=False)), "--load-format", "dummy",
            "--seed", "0"]
    if args.prompt_mode == "tokens":
        base.append("--skip-tokenizer-init")
    if args.smoke:
        return base + ["--dtype", "float32", "--device", "cpu", "--max-model-len", "256",
                       "--max-num-seqs", "8"]
    return base + ["--dtype", "bfloat16", "--max-model-len", "1024", "--max-num-seqs", "256",
                   "--gpu-memory-utilization", str(args.gpu_memory_utilization)]


def minivllm_server_args(args) -> list[str]:
    return server_args(args) + shlex.split(args.minivllm_args)


def vllm_server(args) -> tuple[list[str], dict]:
    """vLLM's OpenAI server on the same model folder (config + byte-level tokenizer) and the
    same flags as minivllm's, from the bundle at $VLLM_SITE (its own fastapi and pydantic:
    nothing of this checkout's PYTHONPATH). --generation-config vllm: no sampling defaults
    from a generation_config.json, as minivllm's server is run here (it has none); with
    --generation-config-json, vLLM's default (auto) reads the folder's, as minivllm's does."""
    if args.smoke:
        raise RuntimeError("vLLM needs a GPU: no smoke run")
    site = os.environ.get("VLLM_SITE")
    if not site:
        raise RuntimeError("VLLM_SITE is not set (source .vllm/install.sh first)")
    genconfig = [] if args.generation_config_json else ["--generation-config", "vllm"]
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *server_args(args),
           *genconfig, *shlex.split(args.vllm_args)]
    return cmd, {"PYTHONPATH": site}


def wait_gpu_released(timeout: float = 90.0, below_gib: float = 2.0) -> None:
    """After a server stops: wait until the GPU's used memory is back under `below_gib`
    (vLLM's engine core is a child process that lets go of its memory later), so the next
    engine starts on an empty GPU. No GPU or no nvidia-ml-py: nothing to wait for."""
    try:
        import pynvml
        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001
        return
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    deadline = time.monotonic() + timeout
    while True:
        used = pynvml.nvmlDeviceGetMemoryInfo(handle).used / 2**30
        if used < below_gib or time.monotonic() > deadline:
            log(f"GPU memory in use after the server stopped: {used:.1f} GiB")
            return
        time.sleep(1.0)


def child_env() -> dict:
    """Children (servers, prepare) import minivllm and bench from this checkout."""
    env = dict(os.environ)
    paths = [str(REPO / "src"), str(REPO)] + [x for x in env.get("PYTHONPATH", "").split(
        os.pathsep) if x]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("HF_HUB_DISABLE_UPDATE_CHECK", "1")  # the transformers CLI asks PyPI
    return env


def launch(label: str, cmd: list[str], kind: str, log_dir: Path, pid_file: Path,
           env: dict | None = None) -> sb.Target:
    port = sb.free_port()
    cmd = cmd + ["--host", "127.0.0.1", "--port", str(port)]
    t = sb.Target(label=label, kind=kind, base_url=f"http://127.0.0.1:{port}/v1",
                  launch_cmd=cmd, log_path=log_dir / f"{label}.log")
    log(f"launching {label}: {shlex.join(cmd)}")
    t.proc = subprocess.Popen(cmd, stdout=open(t.log_path, "w"), stderr=subprocess.STDOUT,
                              env={**child_env(), **(env or {})}, start_new_session=True)
    # run_w3_gpu.sh ends this process group if this script itself gets killed.
    pid_file.write_text(str(t.proc.pid))
    return t


def wait_ready(t: sb.Target, startup_s: float) -> None:
    t0 = time.monotonic()
    try:
        sb.wait_healthy(t, startup_s)  # SystemExit (with the log's tail if it died)
    except SystemExit as e:
        raise RuntimeError(f"{t.label} did not start: {e.code}") from None
    t.info["startup_s"] = round(time.monotonic() - t0, 1)
    log(f"{t.label} healthy after {t.info['startup_s']}s")


def stop(t: sb.Target) -> None:
    """End a server this script started (its own process group): SIGINT, then SIGTERM, then
    SIGKILL, a few seconds apart (transformers serve can linger ~30s after a SIGINT)."""
    if t.proc is None:
        return
    for sig, wait in ((signal.SIGINT, 5), (signal.SIGTERM, 4), (signal.SIGKILL, 4)):
        if t.proc.poll() is not None:
            return
        try:
            os.killpg(t.proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            t.proc.wait(wait)
        except subprocess.TimeoutExpired:
            pass


async def warm_up(t: sb.Target, prompts: Prompts, burst: int) -> list[str]:
    """Two requests alone, then a burst at once (first-use costs out of the first level)."""
    errors = []
    for i in range(2):
        r = await sb.one_request_simple(t, prompts.warm[i], {})
        if not r["ok"]:
            errors.append(r["error"])
    level = await sb.run_level(t, prompts.warm[2:], burst, burst, 8, 120, {},
                               client_procs=CLIENT_PROCS)  # starts the client pool too
    errors += level["errors"]
    return errors


CLIENT_PROCS = 1  # set from --client-procs


async def measure(t: sb.Target, prompts: list, c: int, n: int, out_tokens: int,
                  left: float) -> dict:
    cpu0 = time.process_time()
    server_pid = t.proc.pid if t.proc is not None and Path("/proc").is_dir() else None
    procs0 = proc_cpu.snapshot(server_pid) if server_pid else None
    window0 = time.monotonic()
    server = sb.ServerMetricsSampler(t)
    with sb.GpuMemorySampler() as gpu:
        try:
            level = await asyncio.wait_for(server.run(
                sb.run_level(t, prompts, c, n, out_tokens, max(30.0, left), {},
                             client_procs=CLIENT_PROCS)), left)
        except asyncio.TimeoutError:
            level = {"concurrency": c, "num_requests": n, "completed": None, "failures": None,
                     "errors": [f"level cut off by the time budget after {left:.0f}s"],
                     "timed_out": True}
    level["peak_gpu_mem_gib"] = gpu.peak_gib
    level["gpu_util_mean"] = gpu.util_mean
    window1 = time.monotonic()
    level["window_monotonic"] = [round(window0, 6), round(window1, 6)]
    if procs0 is not None:  # which server process (or thread) was busy, share of a core
        level["server_cpu"] = proc_cpu.shares(procs0, proc_cpu.snapshot(server_pid),
                                              window1 - window0, server_pid)
    level.update(server.result)  # the server's own TTFT, queue time, running/waiting
    # CPU seconds of the client per second of the level, over all its processes; near
    # 1.0 per process means the client may be the limit.
    if level.get("duration_s"):
        cpu = level.get("client_cpu_s", time.process_time() - cpu0)
        level["client_cpu_share"] = round(cpu / level["duration_s"], 2)
    return level


def add_engine_trace(rec: Recorder, entry: dict, trace_path: Path) -> None:
    """Each level's slice of the engine process's step trace (written when the server
    stopped): steps by kind and their times, the loop's time between steps, and the time
    from a request's arrival in the frontend to the engine reading it."""
    from bench import engine_trace

    if not trace_path.exists():
        entry.setdefault("info", {})["engine_trace"] = "not written"
        return
    try:
        trace = engine_trace.load(trace_path)
    except ValueError as e:
        entry.setdefault("info", {})["engine_trace"] = f"unreadable: {e}"
        return
    entry.setdefault("info", {})["engine_trace"] = trace_path.name
    levels = entry.get("levels", []) + rec.payload.get("ramp", {}).get("levels", [])
    for lv in levels:
        if lv.get("window_monotonic"):
            lv["engine"] = e = engine_trace.summarize(trace, *lv["window_monotonic"])
            paths = ", ".join(f"{k} {v['share']:.0%} x {v['mean_ms']} ms"
                              for k, v in e.get("by_path", {}).items())
            log(f"engine at c={lv['concurrency']}: {e['iterations']} iterations ({paths}); "
                f"in steps {e.get('in_step_share')}, between steps "
                f"{e.get('between_steps_ms_mean')} ms, longest iteration "
                f"{e.get('longest_iteration_ms')} ms; arrival to engine "
                f"{e.get('add_arrival_to_engine_ms_mean')} ms")
    rec.save()


def fmt_level(label: str, lv: dict) -> str:
    return (f"{label:16s} c={lv['concurrency']:<5d} n={lv['num_requests']:<5d} "
            f"{lv.get('output_tok_per_s')!s:>10} tok/s  TTFT p50 {lv.get('ttft_ms_p50')} ms  "
            f"ITL p50 {lv.get('itl_ms_p50')} ms  failures {lv.get('failures')}  "
            f"GPU {lv.get('peak_gpu_mem_gib')} GiB, util {lv.get('gpu_util_mean')}%"
            + (f"  [server: TTFT {lv['server_ttft_ms_mean']} ms mean, intake "
               f"{lv.get('server_intake_ms_mean')} ms, running "
               f"{lv.get('server_running_mean')}, waiting {lv.get('server_waiting_mean')}]"
               if "server_ttft_ms_mean" in lv else "")
            + (f"  [CPU: {fmt_cpu(lv['server_cpu'])}]" if lv.get("server_cpu") else ""))


def fmt_cpu(rows: list[dict]) -> str:
    """'root:python3 0.93 (python3 0.71, mv-receiver 0.22), minivllm-engine 1.0'"""
    parts = []
    for r in rows:
        if r["share"] < 0.05:
            continue
        inner = ", ".join(f"{t['name']} {t['share']}" for t in r["threads"])
        parts.append(f"{r['name']} {r['share']}" + (f" ({inner})" if len(r["threads"]) > 1
                                                      else ""))
    return ", ".join(parts)


def estimated_rate(c: int, measured: dict[int, float]) -> float | None:
    """Throughput to plan level c with: the rate of the largest measured level at or below
    c (throughput grows with concurrency, so that overestimates the time), else the lowest
    measured rate scaled down in proportion to c (it grows at most linearly)."""
    below = [k for k in measured if k <= c]
    if below:
        return measured[max(below)]
    if measured:
        return min(rate * c / k for k, rate in measured.items())
    return None


def sweep(t: sb.Target, rec: Recorder, entry: dict, args, prompts: Prompts, budget: Budget,
          levels: list[int], out_tokens: int) -> float | None:
    measured: dict[int, float] = {}
    for c in sorted(levels, key=lambda c: (c != FIRST_LEVEL, c)):
        n, why = plan_level(c, requests_at(args, c), out_tokens, estimated_rate(c, measured),
                            budget.left())
        if n is None:
            entry["levels"].append({"concurrency": c, "skipped": why})
            rec.save()
            log(f"{t.label} c={c}: skipped ({why})")
            continue
        lv = asyncio.run(measure(t, prompts.at(c), c, n, out_tokens, budget.left()))
        entry["levels"].append(lv)
        rec.save()
        log(fmt_level(t.label, lv))
        if lv.get("output_tok_per_s"):
            measured[c] = lv["output_tok_per_s"]
    return measured[max(measured)] if measured else None


def ramp(t: sb.Target, rec: Recorder, args, prompts: Prompts, budget: Budget,
         last_tok_s: float | None, sweep_levels: list[dict]) -> None:
    """Raise concurrency (one round per level) until a request fails or the cap; the sweep's
    levels count too. Stops early on the budget: then the result is a lower bound."""
    ok = [lv["concurrency"] for lv in sweep_levels if lv.get("failures") == 0]
    failed = [lv["concurrency"] for lv in sweep_levels if lv.get("failures")]
    info = {"levels": [], "cap": max(args.ramp + args.concurrency),
            "memory_budget": f"--gpu-memory-utilization {args.gpu_memory_utilization}",
            "server_args": shlex.join(minivllm_server_args(args)),
            "first_failure": min(failed) if failed else None, "stopped_by": None}
    rec.payload["ramp"] = info
    for c in ([] if failed else args.ramp):
        n, why = plan_level(c, c, args.output_tokens, last_tok_s, budget.left())
        if n is None:
            info["stopped_by"] = f"time budget at c={c}: {why}"
            break
        lv = asyncio.run(measure(t, prompts.at(c), c, n, args.output_tokens, budget.left()))
        info["levels"].append(lv)
        log("ramp " + fmt_level(t.label, lv))
        if lv.get("timed_out"):
            info["stopped_by"] = f"time budget: the level at c={c} was cut off"
            break
        if lv.get("failures") == 0:
            ok.append(c)
            last_tok_s = lv.get("output_tok_per_s") or last_tok_s
        else:
            info["first_failure"] = c
            break
        info["max_concurrency_without_failure"] = max(ok) if ok else None
        rec.save()
    below = [c for c in ok if info["first_failure"] is None or c < info["first_failure"]]
    info["max_concurrency_without_failure"] = max(below) if below else None
    info["reached_cap"] = info["first_failure"] is None and info["stopped_by"] is None
    rec.save()
    log(f"ramp: largest concurrency without a failure {info['max_concurrency_without_failure']}"
        f" (first failure: {info['first_failure']}, stopped by: {info['stopped_by']})")


def run_http_part(args, part: str) -> int:
    budget = Budget(args.budget_s)
    log_dir = Path(args.log_dir or Path(args.work) / "logs")
    log_dir.mkdir(parents=True, exist_ok=True)
    variant = GENCONFIG_LABEL if args.generation_config_json else ""
    if args.client_temperature is None:
        variant += SAMPLED_LABEL
    elif args.client_temperature:
        variant += f"-t{args.client_temperature:g}"
    if part == "minivllm":
        label, kind, levels = (args.label or "minivllm") + variant, "minivllm", args.concurrency
    elif part == "vllm":
        label, kind, levels = (args.label or "vllm") + variant, "vllm", args.concurrency
    else:
        label = "transformers" if args.plain else "transformers-cb"
        kind = "transformers"
        levels = args.plain_concurrency if args.plain else args.concurrency
    out = Path(args.out_dir) / f"w3_{label}.json"
    pid_file = Path(args.work) / "server.pid"
    rec = Recorder(out, args, part)
    entry = rec.target(label=label, kind=kind, launch_cmd=None, info={})
    t = None
    trace_path = None
    try:
        if part == "minivllm":
            cmd = [sys.executable, "-m", "minivllm.server", "--disable-log-requests",
                   "--log-level", "warning"] + minivllm_server_args(args)
            prompts = Prompts(args, as_tokens=args.prompt_mode == "tokens")
        elif part == "vllm":
            cmd, server_env = vllm_server(args)
            prompts = Prompts(args, as_tokens=args.prompt_mode == "tokens")
        else:
            # In a child process: this one must not hold a CUDA context (or cached memory)
            # while the server runs, or the GPU memory readings would include it.
            folder = model_dir(args, hf_weights=True)
            subprocess.run([sys.executable, "-m", "bench.w3_gpu", "prepare", "--hf-weights",
                            "--work", args.work, "--model-config", args.model_config]
                           + (["--smoke"] if args.smoke else []), check=True,
                           timeout=max(30.0, budget.left()), cwd=REPO, env=child_env())
            cmd = [sys.executable, "-m", "transformers.cli.transformers", "serve", str(folder),
                   "--log-level", "warning"]
            if not args.plain:
                cmd.append("--continuous-batching")
            cmd += (["--device", "cpu", "--dtype", "float32"] if args.smoke
                    else ["--device", "cuda", "--dtype", "bfloat16"])
            cmd += shlex.split(args.transformers_args)
            prompts = Prompts(args, as_tokens=False)
        trace_env = server_env if part == "vllm" else {}
        if part == "minivllm":  # the engine process's step trace, cut into levels at the end
            trace_path = log_dir / f"engine_trace_{label}.json"
            trace_path.unlink(missing_ok=True)
            trace_env = {"MINIVLLM_ENGINE_TRACE": str(trace_path)}
        t = launch(label, cmd, kind, log_dir, pid_file, trace_env)
        entry["launch_cmd"] = shlex.join(t.launch_cmd)
        entry["base_url"] = t.base_url
        wait_ready(t, max(10.0, budget.left()))
        sb.discover(t, {})
        entry.update(model=t.model, info=t.info)
        try:
            errs = asyncio.run(asyncio.wait_for(warm_up(t, prompts, min(WARM_BURST, max(levels))),
                                                max(10.0, budget.left())))
        except asyncio.TimeoutError:
            errs = ["warm-up cut off by the time budget"]
        if errs:
            entry["warmup_errors"] = errs[:5]
            log(f"{label} warm-up errors: {errs[:3]}")
        entry["info"]["ready_after_s"] = round(args.budget_s - budget.left() - STOP_RESERVE_S, 1)
        rec.save()
        last = sweep(t, rec, entry, args, prompts, budget, levels, args.output_tokens)
        if part == "minivllm" and args.ramp:
            ramp(t, rec, args, prompts, budget, last, entry["levels"])
    except BaseException as e:  # noqa: BLE001 - a start-up failure or a time limit: keep the record
        entry["error"] = f"{type(e).__name__}: {e}"[-3000:]
        log(f"{label}: {entry['error'][-1500:]}")
        if not isinstance(e, (KeyboardInterrupt, RuntimeError)):
            traceback.print_exc()
    finally:
        if t is not None:
            stop(t)
            pid_file.unlink(missing_ok=True)
            wait_gpu_released()
        if trace_path is not None:
            add_engine_trace(rec, entry, trace_path)
        if t is not None and t.log_path is not None and t.log_path.exists():
            entry["server_log_tail"] = t.log_path.read_text(errors="replace")[-2000:]
        rec.save()
        log(f"wrote {out}")
    return 1 if entry.get("error") else 0


# ---- the offline engine on the same requests ------------------------------------------------

def run_offline(args) -> int:
    """The same closed loop on minivllm's LLMEngine in-process, built from the very flags the
    server got: `c` requests in flight, a new one as soon as one finishes; TTFT and ITL from
    the moments outputs leave engine.step()."""
    budget = Budget(args.budget_s)
    prompts = Prompts(args, as_tokens=True)  # the very ids the servers' text prompts are
    out = Path(args.out_dir) / "w3_minivllm-offline.json"
    rec = Recorder(out, args, "offline")
    flags = minivllm_server_args(args)
    entry = rec.target(label="minivllm-offline", kind="offline", base_url=None,
                       launch_cmd=None, info={"engine_args": shlex.join(flags)})
    try:
        import logging

        from minivllm.engine.llm_engine import LLMEngine, freeze_startup_objects
        from minivllm.sampling_params import SamplingParams
        from minivllm.server.launch import add_serve_arguments, engine_config_from_args

        logging.basicConfig(level=logging.WARNING)
        parser = argparse.ArgumentParser()
        add_serve_arguments(parser)
        t0 = time.monotonic()
        engine = LLMEngine(engine_config_from_args(parser.parse_args(flags)))
        freeze_startup_objects()  # as the server's engine process does: like for like
        entry["model"] = str(engine.model_path)
        entry["info"]["startup_s"] = round(time.monotonic() - t0, 1)
        params = SamplingParams(temperature=0.0, max_tokens=args.output_tokens, ignore_eos=True)
        warm = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        for p in prompts.warm[:WARM_BURST]:  # as the server parts' warm-up burst
            engine.add_request(p, warm)
        while engine.has_unfinished_requests():
            engine.step()
        order = sorted(args.concurrency, key=lambda c: (c != FIRST_LEVEL, c))
        last = None
        for c in order:
            n, why = plan_level(c, requests_at(args, c), args.output_tokens, last, budget.left())
            if n is None:
                entry["levels"].append({"concurrency": c, "skipped": why})
                rec.save()
                continue
            with sb.GpuMemorySampler() as gpu:
                lv = offline_level(engine, prompts.at(c), params, c, n, budget)
            lv["peak_gpu_mem_gib"] = gpu.peak_gib
            entry["levels"].append(lv)
            entry["levels"].sort(key=lambda x: x["concurrency"])
            rec.save()
            log(fmt_level("minivllm-offline", lv))
            last = lv.get("output_tok_per_s") or last
    except BaseException as e:  # noqa: BLE001
        entry["error"] = f"{type(e).__name__}: {e}"[-3000:]
        log(f"offline: {entry['error']}")
        if not isinstance(e, KeyboardInterrupt):
            traceback.print_exc()
    finally:
        rec.save()
        log(f"wrote {out}")
    return 1 if entry.get("error") else 0


def offline_level(engine, prompts, params, c: int, n: int, budget: Budget) -> dict:
    return sb.offline_level(engine, prompts, params, c, n, time_left=budget.left)


# ---- main -------------------------------------------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("part", choices=["prepare", "minivllm", "offline", "transformers", "vllm"])
    p.add_argument("--work", default="/tmp/minivllm-w3", help="Model folder and server logs.")
    p.add_argument("--out-dir", default=str(REPO / "bench" / "results" / "w3"))
    p.add_argument("--log-dir", default=None, help="Server logs (default WORK/logs).")
    p.add_argument("--smoke", action="store_true", help="Tiny model on the CPU, tiny sizes.")
    p.add_argument("--model-config", default=str(DEFAULT_MODEL_CONFIG))
    p.add_argument("--budget-s", type=float, default=170, help="Seconds this part may take.")
    p.add_argument("--concurrency", type=int, nargs="+", default=None)
    p.add_argument("--ramp", type=int, nargs="*", default=None,
                   help=f"Levels past the sweep, one round each (default {DEFAULT_RAMP}).")
    p.add_argument("--plain-concurrency", type=int, nargs="+", default=None,
                   help="Levels for plain transformers serve (default 1 8).")
    p.add_argument("--plain", action="store_true",
                   help="transformers serve without --continuous-batching.")
    p.add_argument("--prompt-tokens", type=int, default=None)
    p.add_argument("--output-tokens", type=int, default=None)
    p.add_argument("--rounds", type=float, default=2.0)
    p.add_argument("--min-requests", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompt-mode", choices=["text", "tokens"], default="text",
                   help="text (default): every server gets the word-level text of the same "
                        "token ids and detokenizes; tokens: minivllm gets the ids with "
                        "--skip-tokenizer-init (its chunks then carry no text, so the client "
                        "cannot count tokens in a chunk that holds several).")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3,
                   help="minivllm's memory budget, for the sweep and the ramp alike.")
    p.add_argument("--minivllm-args", default="", help="Extra flags for minivllm (server and "
                                                       "offline engine alike).")
    p.add_argument("--transformers-args", default="", help="Extra flags for transformers serve.")
    p.add_argument("--vllm-args", default="", help="Extra flags for vLLM's server.")
    p.add_argument("--hf-weights", action="store_true", help="prepare: also write HF weights.")
    p.add_argument("--generation-config-json", default=None, metavar="PATH",
                   help="minivllm and vllm parts (and prepare): copy PATH into the model "
                        "folder as generation_config.json and let both servers read it (their "
                        "default, auto), for the sampling fields the client leaves unset; "
                        "labels get -genconfig. Default: no file, vLLM with "
                        "--generation-config vllm.")
    p.add_argument("--client-temperature", type=_temperature, default=0.0,
                   metavar="T|unset",
                   help="The temperature each request sends (default 0: greedy); 'unset' "
                        "sends none, so the server's default applies (with "
                        "--generation-config-json, the file's temperature).")
    p.add_argument("--structured", action="store_true",
                   help="W8 through the server: every other request carries a JSON schema "
                        "(bench.w8_structured's four) in structured_outputs.")
    p.add_argument("--tokenizer-dir", default=None, metavar="DIR",
                   help="A real tokenizer's folder for the model (e.g. /tmp/qwen25) instead of "
                        "the byte-level one: prompts of --prompt-tokens characters are then "
                        "fewer tokens (for --structured: grammars over a real vocabulary).")
    p.add_argument("--label", default=None,
                   help="minivllm part: the label (and file name) of this server variant, "
                        "e.g. minivllm-api2 with --minivllm-args='--api-servers 2' "
                        "(default minivllm: the one the report compares with the offline "
                        "engine).")
    p.add_argument("--client-procs", type=int, default=None,
                   help="Client processes per level (default: 3/8 of the CPUs, at most 8: "
                        "6 on the 16-CPU H200 host, where 4 processes were each ~75%% busy "
                        "at c=64; 1 on a machine of 5 CPUs or fewer).")
    args = p.parse_args(argv)
    if args.generation_config_json:
        if args.part in ("offline", "transformers") or args.hf_weights:
            p.error("--generation-config-json: the minivllm and vllm parts only, and prepare "
                    "without --hf-weights (the offline engine and transformers serve do not "
                    "read the file here)")
        if any(a.split("=")[0] == "--generation-config"
               for a in shlex.split(args.minivllm_args + " " + args.vllm_args)):
            p.error("--generation-config-json: leave --generation-config out of the servers' "
                    "flags (both must read the model folder's file)")
        try:
            content = generation_config(args)
        except (OSError, ValueError) as e:
            p.error(f"--generation-config-json {args.generation_config_json}: {e}")
        if not isinstance(content, dict):
            p.error(f"--generation-config-json {args.generation_config_json}: not a JSON "
                    "object")
    if args.client_temperature is None and not args.generation_config_json:
        p.error("--client-temperature unset needs --generation-config-json (without a file "
                "the servers' defaults differ: vLLM's --generation-config vllm is 1.0)")
    if args.part in ("offline", "transformers") and args.client_temperature != 0.0:
        p.error("--client-temperature: the minivllm and vllm parts only")
    if args.client_procs is None:
        args.client_procs = max(1, min(8, (os.cpu_count() or 1) * 3 // 8))
    smoke = args.smoke
    if args.concurrency is None:
        args.concurrency = [1, 2, 4] if smoke else DEFAULT_CONCURRENCY
    if args.ramp is None:
        args.ramp = [8, 16] if smoke else DEFAULT_RAMP
    if args.plain_concurrency is None:
        args.plain_concurrency = [1, 2] if smoke else [1, 8]
    if args.prompt_tokens is None:
        args.prompt_tokens = 16 if smoke else 128
    if args.output_tokens is None:
        args.output_tokens = 8 if smoke else 128
    return args


def _temperature(text: str) -> float | None:
    if text == "unset":
        return None
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"a temperature is >= 0 or 'unset', not {text!r}")
    return value


def main(argv=None) -> int:
    global CLIENT_PROCS
    args = parse_args(argv)
    CLIENT_PROCS = args.client_procs
    sb.CLIENT_TEMPERATURE = args.client_temperature
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.structured:
        from bench.w8_structured import SCHEMAS
        sb.STRUCTURED_SCHEMAS[:] = SCHEMAS
    if args.part == "prepare":
        log(f"model folder: {prepare(args, args.hf_weights)}")
        return 0
    if args.part == "offline":
        return run_offline(args)
    return run_http_part(args, args.part)


if __name__ == "__main__":
    raise SystemExit(main())
