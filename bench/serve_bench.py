"""W3 serving benchmark: streaming clients against any OpenAI-compatible server.

For each concurrency level, `c` clients send streaming /v1/completions requests back to
back (closed loop) until the level's requests are done: prompts of N tokens (random
token ids where the server takes them, else a text of about N tokens), M output tokens
forced where the server allows it (vLLM/minivllm: ignore_eos; transformers serve:
generation_config min_new_tokens). Reported per level: output tokens/s, requests/s, TTFT
and inter-token latency p50/p99, TPOT, failures, and peak GPU memory (nvidia-ml-py, if
present). Results go to bench/results/DATE-MACHINE-w3-NAME/ (with machine info, versions, git commit)
and a Markdown table (bench/serve_report.py).

The client needs only httpx (and transformers' tokenizer for text prompts), so it can
measure vLLM or `transformers serve` anywhere. It can also launch the servers itself,
side by side, in one run:

    # minivllm and transformers serve on the CPU, default model (SmolLM2-135M-Instruct)
    OMP_NUM_THREADS=1 python -m bench.serve_bench --launch minivllm transformers \\
        --concurrency 1 4 8 --prompt-tokens 64 --output-tokens 32 \\
        --minivllm-args "--max-model-len 1024" --transformers-args "--dtype float32 --device cpu"

    # an already running server (vLLM, minivllm, ...)
    python -m bench.serve_bench --base-url http://127.0.0.1:8000/v1 --kind vllm
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

try:
    import httpx
except ImportError:  # machines that only have the openai SDK's fork of it
    import httpx2 as httpx  # type: ignore[no-redef]

from bench.common import default_result_path  # noqa: E402  (torch-free at import)

BENCH_DIR = Path(__file__).resolve().parent
KINDS = ("minivllm", "vllm", "transformers", "openai")


# ---- targets -------------------------------------------------------------------------------

@dataclass
class Target:
    label: str
    kind: str                      # how to phrase requests: see request_body()
    base_url: str = ""             # ending in /v1
    model: str | None = None
    launch_cmd: list[str] | None = None
    proc: subprocess.Popen | None = None
    log_path: Path | None = None
    info: dict = field(default_factory=dict)

    @property
    def forces_length(self) -> bool:
        return self.kind in ("minivllm", "vllm", "transformers")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_target(kind: str, args: argparse.Namespace, log_dir: Path) -> Target:
    port = free_port()
    model_path = args.model_path or default_model_path()
    if kind == "minivllm":
        cmd = [sys.executable, "-m", "minivllm.server", "--host", "127.0.0.1", "--port",
               str(port), "--disable-log-requests", "--log-level", "warning"]
        if args.model_path:
            cmd += ["--model", args.model_path]
        cmd += shlex.split(args.minivllm_args)
        label, req_kind = "minivllm", "minivllm"
    elif kind in ("transformers", "transformers-cb"):
        if model_path is None:
            raise SystemExit("--model-path is needed to launch transformers serve")
        # The module form works where the `transformers` script is not on PATH (the H200).
        cmd = [sys.executable, "-m", "transformers.cli.transformers", "serve", str(model_path), "--host", "127.0.0.1", "--port", str(port),
               "--log-level", "warning"]
        if kind == "transformers-cb":
            cmd.append("--continuous-batching")
        cmd += shlex.split(args.transformers_args)
        label, req_kind = kind, "transformers"
    else:
        raise SystemExit(f"cannot launch {kind!r}")
    log_path = log_dir / f"{label}-{port}.log"
    t = Target(label=label, kind=req_kind, base_url=f"http://127.0.0.1:{port}/v1",
               launch_cmd=cmd, log_path=log_path)
    env = dict(os.environ)
    env.setdefault("HF_HUB_DISABLE_UPDATE_CHECK", "1")  # no network: don't ask PyPI
    env.setdefault("OMP_NUM_THREADS", "1")
    print(f"[serve_bench] launching {label}: {shlex.join(cmd)}", flush=True)
    log = open(log_path, "w")
    t.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                              start_new_session=True)
    wait_healthy(t, args.startup_timeout)
    return t


def wait_healthy(t: Target, timeout: float) -> None:
    root = t.base_url.rsplit("/v1", 1)[0]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if t.proc is not None and t.proc.poll() is not None:
            tail = t.log_path.read_text()[-3000:] if t.log_path else ""
            raise SystemExit(f"{t.label} exited with {t.proc.returncode} during start-up:\n{tail}")
        try:
            if httpx.get(root + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{t.label} did not become healthy in {timeout:.0f}s")


def stop_target(t: Target) -> None:
    """End the server this script started (its own process group), politely first."""
    if t.proc is None or t.proc.poll() is not None:
        return
    try:
        os.killpg(t.proc.pid, signal.SIGINT)
        t.proc.wait(10)
    except (subprocess.TimeoutExpired, ProcessLookupError):
        try:
            os.killpg(t.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        t.proc.wait(10)


def discover(t: Target, headers: dict) -> None:
    root = t.base_url.rsplit("/v1", 1)[0]
    try:
        models = httpx.get(t.base_url + "/models", headers=headers, timeout=10).json()["data"]
        if t.model is None and models:
            t.model = models[0]["id"]
        t.info["models"] = [m.get("id") for m in models]
    except Exception as e:  # noqa: BLE001
        t.info["models_error"] = repr(e)
    try:
        r = httpx.get(root + "/version", timeout=5)
        if r.status_code == 200:
            t.info["server_version"] = r.json().get("version")
    except Exception:  # noqa: BLE001
        pass


def default_model_path() -> str | None:
    try:
        from minivllm.default_model import default_model_dir, is_default_model_ready
        if is_default_model_ready():
            return str(default_model_dir())
    except Exception:  # noqa: BLE001
        pass
    return None


# ---- prompts -------------------------------------------------------------------------------

def load_tokenizer(path: str | None):
    if not path:
        return None
    try:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:  # noqa: BLE001
        print(f"[serve_bench] no tokenizer from {path}: {e}", flush=True)
        return None


_WORDS = ("time people year way day man thing woman life child world school state family "
          "student group country problem hand part place case week company system program "
          "question work government number night point home water room mother area money "
          "story fact month lot right study book eye job word business issue side kind head "
          "house service friend father power hour game line end member law car city").split()


def make_prompts(num: int, n_tokens: int, mode: str, tokenizer, vocab_size: int,
                 seed: int) -> list:
    """`num` prompts of about n_tokens: token-id lists (mode "tokens") or texts."""
    rng = random.Random(seed)
    if mode == "tokens":
        lo = min(1000, vocab_size // 4)
        return [[rng.randrange(lo, vocab_size) for _ in range(n_tokens)] for _ in range(num)]
    prompts = []
    for _ in range(num):
        if tokenizer is None:
            prompts.append(" ".join(rng.choice(_WORDS) for _ in range(n_tokens)))
            continue
        vocab = len(tokenizer)
        ids = [rng.randrange(min(1000, vocab // 4), vocab) for _ in range(n_tokens)]
        text = tokenizer.decode(ids, skip_special_tokens=True)
        for _ in range(8):  # re-tokenizing changes the length a little: adjust
            have = len(tokenizer.encode(text, add_special_tokens=False))
            if have == n_tokens:
                break
            if have > n_tokens:
                ids = ids[:max(1, len(ids) - (have - n_tokens))]
            else:
                ids += [rng.randrange(min(1000, vocab // 4), vocab)
                        for _ in range(n_tokens - have)]
            text = tokenizer.decode(ids, skip_special_tokens=True)
        prompts.append(text)
    return prompts


# W8 through the server (--structured): every other request asks for one of these JSON
# schemas (vLLM's and minivllm's structured_outputs field); set by the harness's flag.
STRUCTURED_SCHEMAS: list[dict] = []


# The temperature every request sends; None leaves it out, so the server's default applies
# (a model's generation_config.json, else OpenAI's 1.0). Set by the harness's flag.
CLIENT_TEMPERATURE: float | None = 0.0


def request_body(t: Target, prompt, output_tokens: int, index: int = 0) -> dict:
    body = {"model": t.model, "prompt": prompt, "max_tokens": output_tokens, "stream": True}
    if CLIENT_TEMPERATURE is not None:
        body["temperature"] = CLIENT_TEMPERATURE
    if STRUCTURED_SCHEMAS and index % 2 == 0:
        body["structured_outputs"] = {
            "json": STRUCTURED_SCHEMAS[(index // 2) % len(STRUCTURED_SCHEMAS)]}
    if t.kind in ("minivllm", "vllm"):
        body["ignore_eos"] = True
        body["stream_options"] = {"include_usage": True}
    elif t.kind == "transformers":
        body["generation_config"] = json.dumps({"max_new_tokens": output_tokens,
                                                "min_new_tokens": output_tokens,
                                                "do_sample": False})
    else:
        body["stream_options"] = {"include_usage": True}
    return body


# ---- one request, one level ----------------------------------------------------------------

async def one_request(client: httpx.AsyncClient, url: str, body: dict) -> dict:
    t0 = time.perf_counter()
    ttft = None
    last = None
    itls: list[float] = []
    events = 0
    usage_tokens = None
    error = None
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode("utf-8", "replace")
                raise RuntimeError(f"HTTP {r.status_code}: {text[:300]}")
            done = False
            async for line in r.aiter_lines():
                # After [DONE], read on to the end of the body: leaving it unread would
                # make httpx close the connection, and every request would then pay a new
                # TCP connection (the openai client drains the stream the same way).
                if done or not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    continue
                obj = json.loads(data)
                if "error" in obj:
                    raise RuntimeError(f"stream error: {obj['error']}")
                if obj.get("usage"):
                    usage_tokens = obj["usage"].get("completion_tokens")
                choices = obj.get("choices") or []
                # A token event: new text, or new tokens without text (a server without
                # a tokenizer), i.e. anything but an empty closing chunk -- except that
                # the first chunk with choices always counts (a whole short answer can
                # arrive in one closing chunk).
                if choices and (ttft is None or any(
                        (c.get("text") or (c.get("delta") or {}).get("content"))
                        or c.get("finish_reason") is None for c in choices)):
                    now = time.perf_counter()
                    if ttft is None:
                        ttft = now - t0
                    else:
                        itls.append(now - last)
                    last = now
                    events += 1
    except Exception as e:  # noqa: BLE001 - counted as a failure
        error = f"{type(e).__name__}: {e}"
    return {"ok": error is None and ttft is not None, "error": error or (
        None if ttft is not None else "no tokens received"), "ttft": ttft, "itls": itls,
        "latency": time.perf_counter() - t0, "events": events, "usage_tokens": usage_tokens}


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * q / 100.0
    lo, hi = int(k), min(int(k) + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


async def _run_requests(url: str, bodies: list[dict], concurrency: int, timeout: float,
                        headers: dict, start_at: float | None = None) -> tuple[list[dict], float]:
    """`concurrency` closed-loop workers sending `bodies` in order (one asyncio loop).
    The HTTP client is made first; the first request goes out at `start_at`
    (time.monotonic, system-wide on Linux) if given. Returns (results, time of the first
    request)."""
    limits = httpx.Limits(max_connections=concurrency + 4,
                          max_keepalive_connections=concurrency + 4)
    results: list[dict] = []
    next_index = 0

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal next_index
        while next_index < len(bodies):
            i = next_index
            next_index += 1
            results.append(await one_request(client, url, bodies[i]))

    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout), limits=limits,
                                 headers=headers) as client:
        if start_at is not None:
            await asyncio.sleep(max(0.0, start_at - time.monotonic()))
        started = time.monotonic()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    return results, started


def _client_worker(conn) -> None:
    """A client process of a ClientPool: says it is ready (imports done), then runs one
    share of a level per job until it gets None."""
    conn.send("ready")
    while True:
        job = conn.recv()
        if job is None:
            return
        url, bodies, concurrency, timeout, headers, start_at = job
        cpu0 = time.process_time()
        results, started = asyncio.run(
            _run_requests(url, bodies, concurrency, timeout, headers, start_at))
        conn.send((results, started, time.monotonic(), time.process_time() - cpu0))


class ClientPool:
    """`procs` client processes, started once and kept for every level of the run.

    A level's clock starts at a common start time set once every process has started and
    imported (a spawned process re-imports the benchmark's modules, which took seconds on
    the H200 host: counted in the level, that start-up lag had cut a short level's
    throughput by two thirds). Each process reports when its first request really went
    out; the level records the largest lag behind the start time."""

    START_DELAY_S = 0.1  # between sending the jobs and the common start

    def __init__(self, procs: int, ready_timeout: float = 120.0) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        self.conns, self.procs = [], []
        for _ in range(procs):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_client_worker, args=(child,), daemon=True)
            p.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(p)
        for conn in self.conns:
            if not conn.poll(ready_timeout):
                self.close()
                raise RuntimeError(f"a client process was not ready in {ready_timeout:.0f}s")
            conn.recv()

    def __len__(self) -> int:
        return len(self.conns)

    def run(self, url: str, shares: list[list[dict]], concurrencies: list[int],
            timeout: float, headers: dict) -> tuple[float, list[tuple]]:
        """Runs share k on process k (blocking); returns (start time, per-process results)."""
        start_at = time.monotonic() + self.START_DELAY_S
        for conn, share, conc in zip(self.conns, shares, concurrencies):
            conn.send((url, share, conc, timeout, headers, start_at))
        return start_at, [conn.recv() for conn in self.conns[:len(shares)]]

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send(None)
            except OSError:
                pass
        for p in self.procs:
            p.join(5)
            if p.is_alive():
                p.terminate()
        self.conns, self.procs = [], []


_CLIENT_POOLS: dict[int, ClientPool] = {}


def client_pool(procs: int) -> ClientPool:
    """The run's pool of `procs` client processes (started on first use, closed at exit)."""
    if procs not in _CLIENT_POOLS:
        import atexit

        if not _CLIENT_POOLS:
            atexit.register(close_client_pools)
        _CLIENT_POOLS[procs] = ClientPool(procs)
    return _CLIENT_POOLS[procs]


def close_client_pools() -> None:
    while _CLIENT_POOLS:
        _CLIENT_POOLS.popitem()[1].close()


async def run_level(t: Target, prompts: list, concurrency: int, num_requests: int,
                    output_tokens: int, timeout: float, headers: dict,
                    client_procs: int = 1) -> dict:
    """One closed-loop level. client_procs > 1 spreads the streams over that many client
    processes (request i goes to process i mod P), so that parsing thousands of SSE chunks
    a second in Python does not make the client the bottleneck of a fast server."""
    url = t.base_url + "/completions"
    bodies = [request_body(t, prompts[i % len(prompts)], output_tokens, i)
              for i in range(num_requests)]
    procs = max(1, min(client_procs, concurrency, num_requests))
    client_cpu = start_lag = None
    if procs == 1:
        results, started = await _run_requests(url, bodies, concurrency, timeout, headers)
        wall = time.monotonic() - started
    else:
        pool = client_pool(procs)
        shares = [bodies[k::procs] for k in range(procs)]
        conc = [concurrency // procs + (k < concurrency % procs) for k in range(procs)]
        # In a thread, so that this loop (the server-metrics sampler) keeps running.
        start_at, done = await asyncio.get_running_loop().run_in_executor(
            None, pool.run, url, shares, conc, timeout, headers)
        results = [r for rs, _, _, _ in done for r in rs]
        wall = max(end for _, _, end, _ in done) - start_at
        start_lag = max(started for _, started, _, _ in done) - start_at
        client_cpu = sum(cpu for _, _, _, cpu in done)

    ok = [r for r in results if r["ok"]]
    out_tokens = 0
    tpots = []
    for r in ok:
        n = r["usage_tokens"] if r["usage_tokens"] is not None else (
            output_tokens if t.forces_length else r["events"])
        r["tokens"] = n
        out_tokens += n
        if n > 1:
            tpots.append((r["latency"] - r["ttft"]) / (n - 1))
    ttfts = [r["ttft"] for r in ok]
    itls = [x for r in ok for x in r["itls"]]
    ms = lambda x: None if x is None else round(1000 * x, 2)  # noqa: E731
    errors = sorted({r["error"] for r in results if not r["ok"]})
    level = {
        "concurrency": concurrency, "num_requests": num_requests, "completed": len(ok),
        "failures": len(results) - len(ok), "errors": errors[:5],
        "duration_s": round(wall, 3),
        "output_tokens": out_tokens,
        "output_tok_per_s": round(out_tokens / wall, 2) if wall > 0 else None,
        "requests_per_s": round(len(ok) / wall, 3) if wall > 0 else None,
        "ttft_ms_p50": ms(percentile(ttfts, 50)), "ttft_ms_p99": ms(percentile(ttfts, 99)),
        "itl_ms_p50": ms(percentile(itls, 50)), "itl_ms_p99": ms(percentile(itls, 99)),
        "tpot_ms_mean": ms(sum(tpots) / len(tpots)) if tpots else None,
        "latency_s_p50": (round(percentile([r["latency"] for r in ok], 50), 3)
                          if ok else None),
        "tokens_per_event": round(out_tokens / max(1, sum(r["events"] for r in ok)), 2),
        "client_procs": procs,
    }
    if client_cpu is not None:
        level["client_cpu_s"] = round(client_cpu, 3)
        # How late the last client process sent its first request (should be ~0).
        level["client_start_lag_ms"] = round(1000 * start_lag, 2)
    return level


# ---- the server's own view ---------------------------------------------------------------

METRIC_PREFIX = {"minivllm": "minivllm:", "vllm": "vllm:"}
_HISTOGRAMS = {"ttft": "time_to_first_token_seconds", "queue": "request_queue_time_seconds",
               "e2e": "e2e_request_latency_seconds", "itl": "inter_token_latency_seconds",
               # minivllm only: HTTP request in the app -> submitted to the engine
               "intake": "request_intake_seconds"}
_GAUGES = {"running": "num_requests_running", "waiting": "num_requests_waiting"}


def parse_prometheus(text: str, prefix: str) -> dict[str, float]:
    """{metric name without prefix (and labels): value}, summed over label sets."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(prefix):
            continue
        name, _, rest = line.partition("{") if "{" in line.split(" ")[0] else (
            line.split(" ")[0], "", line)
        try:
            value = float(rest.rsplit(" ", 1)[-1])
        except ValueError:
            continue
        key = name[len(prefix):]
        values[key] = values.get(key, 0.0) + value
    return values


class ServerMetricsSampler:
    """What the server says about a level, from its Prometheus /metrics: mean TTFT, queue
    time, end-to-end latency and inter-token latency over the level's requests (histogram
    sums and counts, before and after), and the mean of the running / waiting gauges
    sampled every `interval` seconds. Set against the client's numbers it tells where the
    time goes: in the engine (server TTFT close to the client's) or in HTTP and the client
    (server TTFT much lower), and whether the engine had the whole concurrency running."""

    def __init__(self, t: "Target", interval: float = 0.1) -> None:
        self.prefix = METRIC_PREFIX.get(t.kind)
        self.url = t.base_url.rsplit("/v1", 1)[0] + "/metrics"
        self.interval = interval
        self.result: dict = {}

    async def _scrape(self, client) -> dict[str, float] | None:
        try:
            r = await client.get(self.url)
            return parse_prometheus(r.text, self.prefix) if r.status_code == 200 else None
        except Exception:  # noqa: BLE001 - a diagnostic must not fail the level
            return None

    async def run(self, level_coro):
        """Await level_coro while sampling; returns its result."""
        if self.prefix is None:
            return await level_coro
        async with httpx.AsyncClient(timeout=5) as client:
            before = await self._scrape(client)
            gauges: dict[str, list[float]] = {k: [] for k in _GAUGES}
            stop = asyncio.Event()

            async def sample() -> None:
                while not stop.is_set():
                    m = await self._scrape(client)
                    for k, name in _GAUGES.items():
                        if m and name in m:
                            gauges[k].append(m[name])
                    try:
                        await asyncio.wait_for(stop.wait(), self.interval)
                    except asyncio.TimeoutError:
                        pass

            sampler = asyncio.ensure_future(sample())
            try:
                return await level_coro
            finally:
                stop.set()
                await sampler
                after = await self._scrape(client)
                self.result = self._summary(before, after, gauges)

    @staticmethod
    def _summary(before, after, gauges) -> dict:
        out: dict = {}
        if before is not None and after is not None:
            for k, name in _HISTOGRAMS.items():
                n = after.get(name + "_count", 0) - before.get(name + "_count", 0)
                total = after.get(name + "_sum", 0) - before.get(name + "_sum", 0)
                if n > 0:
                    out[f"server_{k}_ms_mean"] = round(1000 * total / n, 2)
        for k, vals in gauges.items():
            if vals:
                out[f"server_{k}_mean"] = round(sum(vals) / len(vals), 1)
        return out


# ---- GPU memory ------------------------------------------------------------------------------

class GpuMemorySampler:
    """Peak used memory of GPU 0 (all processes) while running, and the mean of NVML's
    utilization (the share of time a kernel was running, over NVML's own sample period),
    via nvidia-ml-py."""

    def __init__(self) -> None:
        self.peak_bytes: int | None = None
        self._utils: list[int] = []
        self._stop = threading.Event()
        self._thread = None
        try:
            import pynvml
            pynvml.nvmlInit()
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(0)
            self._pynvml = pynvml
        except Exception:  # noqa: BLE001 - no GPU or no nvidia-ml-py
            self._pynvml = None

    def __enter__(self) -> "GpuMemorySampler":
        if self._pynvml is not None:
            self.peak_bytes = 0
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                used = self._pynvml.nvmlDeviceGetMemoryInfo(self._handle).used
                self.peak_bytes = max(self.peak_bytes or 0, used)
                self._utils.append(self._pynvml.nvmlDeviceGetUtilizationRates(
                    self._handle).gpu)
            except Exception:  # noqa: BLE001
                return
            self._stop.wait(0.1)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2)

    @property
    def util_mean(self) -> float | None:
        """Percent; None without samples."""
        return round(sum(self._utils) / len(self._utils), 1) if self._utils else None

    @property
    def peak_gib(self) -> float | None:
        return None if self.peak_bytes is None else round(self.peak_bytes / 2 ** 30, 2)


# ---- environment -------------------------------------------------------------------------------

def environment() -> dict:
    def version(pkg: str) -> str | None:
        try:
            return metadata.version(pkg)
        except metadata.PackageNotFoundError:
            return None

    env = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "git_commit": git_commit(),
    }
    for pkg in ("minivllm", "torch", "triton", "transformers", "vllm", "httpx", "fastapi",
                "uvicorn"):
        env[pkg] = version(pkg)
    try:
        cpu = next((line.split(":", 1)[1].strip() for line in
                    open("/proc/cpuinfo").read().splitlines() if line.startswith("model name")),
                   None)
        env["cpu"] = cpu
    except OSError:
        pass
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                              "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=10)
        env["gpu"] = out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        env["gpu"] = None
    return env


def git_commit() -> str:
    # The GPU machine's .git is not ours: its scripts export MINIVLLM_GIT_COMMIT (from
    # bench/.commit), which wins (a W3 run there recorded a wrong "bd1c6fb-dirty").
    if os.environ.get("MINIVLLM_GIT_COMMIT"):
        return os.environ["MINIVLLM_GIT_COMMIT"]
    try:
        commit = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=BENCH_DIR,
                                         text=True, stderr=subprocess.DEVNULL).strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=BENCH_DIR,
                               stderr=subprocess.DEVNULL).returncode != 0
        return commit + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


# ---- main --------------------------------------------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--base-url", action="append", default=[],
                   help="An OpenAI-compatible server to measure (…/v1); repeatable.")
    p.add_argument("--kind", action="append", default=[], choices=KINDS,
                   help="How to phrase requests for each --base-url (default minivllm): "
                        "minivllm/vllm send ignore_eos; transformers sends generation_config "
                        "with min_new_tokens; openai sends plain fields.")
    p.add_argument("--label", action="append", default=[], help="Names for --base-url targets.")
    p.add_argument("--model", default=None,
                   help="Model name to request (default: the server's first /v1/models id).")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="Bearer token to send (default $OPENAI_API_KEY).")
    p.add_argument("--launch", nargs="+", default=[],
                   choices=["minivllm", "transformers", "transformers-cb"],
                   help="Servers to start here, one after another, on free ports.")
    p.add_argument("--offline-minivllm", action="store_true",
                   help="Also run the same closed-loop workload on minivllm's engine "
                        "in-process (no HTTP; engine flags from --minivllm-args): the "
                        "server's overhead is the gap to it.")
    p.add_argument("--log-dir", default=None,
                   help="Where launched servers log (default: a temporary folder).")
    p.add_argument("--model-path", default=None,
                   help="Model folder for launched servers (default: minivllm's default "
                        "model, SmolLM2-135M-Instruct).")
    p.add_argument("--minivllm-args", default="", help="Extra flags for `minivllm serve`.")
    p.add_argument("--transformers-args", default="",
                   help="Extra flags for `transformers serve` (e.g. '--dtype float32 "
                        "--device cpu').")
    p.add_argument("--startup-timeout", type=float, default=900)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256])
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--rounds", type=float, default=2.0,
                   help="Requests per level = max(min-requests, rounds x concurrency).")
    p.add_argument("--min-requests", type=int, default=4)
    p.add_argument("--prompt-mode", choices=["auto", "text", "tokens"], default="auto",
                   help="tokens: random token ids (minivllm/vllm only); text: ~N tokens of "
                        "text; auto: text when a tokenizer is available, else tokens where "
                        "the server takes them.")
    p.add_argument("--tokenizer", default=None,
                   help="Tokenizer folder for text prompts (default: --model-path or the "
                        "default model).")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="Token-id range for token prompts (default: the tokenizer's, else "
                        "32000).")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=2, help="Warm-up requests per target.")
    p.add_argument("--timeout", type=float, default=1800, help="Per-request timeout (s).")
    p.add_argument("--client-procs", type=int, default=1,
                   help="Client processes per level (streams spread over them): more than "
                        "one keeps a single Python client from being the bottleneck.")
    p.add_argument("--out", default=None, help="JSON path (default bench/results/DATE-MACHINE-w3-NAME/w3-NAME.json).")
    p.add_argument("--markdown", default=None,
                   help="Markdown table path (default: the JSON path with .md).")
    p.add_argument("--name", default=None, help="Tag for the result file name.")
    return p.parse_args(argv)


def level_sizes(args) -> list[int]:
    """Requests sent at each concurrency level."""
    return [max(args.min_requests, int(round(args.rounds * c))) for c in args.concurrency]


def split_prompts(prompts: list, args) -> tuple[list, list[list]]:
    """(warm-up prompts, one fresh slice of prompts per level)."""
    warm, rest = prompts[:args.warmup], prompts[args.warmup:]
    slices, at = [], 0
    for n in level_sizes(args):
        slices.append(rest[at:at + n])
        at += n
    return warm, slices


async def bench_target(t: Target, args, prompts_for, headers) -> list[dict]:
    levels = []
    warm_prompts, level_prompts = split_prompts(prompts_for(t), args)
    for prompt in warm_prompts:
        warm = await one_request_simple(t, prompt, headers)
        if not warm["ok"]:
            print(f"[serve_bench] {t.label}: warm-up failed: {warm['error']}", flush=True)
    for c, n, prompts in zip(args.concurrency, level_sizes(args), level_prompts):
        with GpuMemorySampler() as gpu:
            level = await run_level(t, prompts, c, n, args.output_tokens, args.timeout,
                                    headers, client_procs=args.client_procs)
        level["peak_gpu_mem_gib"] = gpu.peak_gib
        levels.append(level)
        print(f"[serve_bench] {t.label:16s} c={c:<4d} {level['output_tok_per_s']!s:>9} tok/s  "
              f"TTFT p50 {level['ttft_ms_p50']} ms  ITL p50 {level['itl_ms_p50']} ms  "
              f"failures {level['failures']}", flush=True)
    return levels


async def one_request_simple(t: Target, prompt, headers) -> dict:
    async with httpx.AsyncClient(timeout=httpx.Timeout(600), headers=headers) as client:
        return await one_request(client, t.base_url + "/completions",
                                 request_body(t, prompt, 8))


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.base_url and not args.launch:
        args.launch = ["minivllm"]
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="serve_bench_logs_"))
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"[serve_bench] server logs in {log_dir}", flush=True)

    tok_path = args.tokenizer or args.model_path or default_model_path()
    tokenizer = load_tokenizer(tok_path) if args.prompt_mode != "tokens" else None
    vocab = args.vocab_size or (len(tokenizer) if tokenizer is not None else 32000)
    # Every request gets a prompt of its own (the same sequence for every target), so no
    # engine's prefix cache sees a repeated prompt.
    max_requests = args.warmup + sum(level_sizes(args))
    text_prompts = token_prompts = None

    def prompts_for(t: Target) -> list:
        nonlocal text_prompts, token_prompts
        mode = args.prompt_mode
        if mode == "auto":
            mode = "text" if tokenizer is not None or t.kind not in ("minivllm", "vllm") \
                else "tokens"
        if mode == "tokens":
            if token_prompts is None:
                token_prompts = make_prompts(max_requests, args.prompt_tokens, "tokens", None,
                                             vocab, args.seed)
            return token_prompts
        if text_prompts is None:
            text_prompts = make_prompts(max_requests, args.prompt_tokens, "text", tokenizer,
                                        vocab, args.seed)
        return text_prompts

    targets: list[Target] = []
    for i, url in enumerate(args.base_url):
        kind = args.kind[i] if i < len(args.kind) else "minivllm"
        label = args.label[i] if i < len(args.label) else f"{kind}@{url}"
        targets.append(Target(label=label, kind=kind, base_url=url.rstrip("/"),
                              model=args.model))
    results = []
    try:
        for t in targets:
            discover(t, headers)
            results.append(_run_one(t, args, prompts_for, headers))
        for kind in args.launch:
            t = launch_target(kind, args, log_dir)
            try:
                discover(t, headers)
                results.append(_run_one(t, args, prompts_for, headers))
            finally:
                stop_target(t)
        if args.offline_minivllm:
            results.append(run_offline_minivllm(args, prompts_for))
    except KeyboardInterrupt:
        print("[serve_bench] interrupted; writing what was measured", flush=True)

    payload = {
        "benchmark": "w3_serve",
        "environment": environment(),
        "workload": {
            "prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens,
            "concurrency": args.concurrency, "rounds": args.rounds,
            "min_requests": args.min_requests, "prompt_mode": args.prompt_mode,
            "tokenizer": tok_path if tokenizer is not None else None, "seed": args.seed,
            "temperature": CLIENT_TEMPERATURE, "stream": True, "endpoint": "/v1/completions",
        },
        "targets": results,
    }
    name = args.name or "-".join(r["label"] for r in results) or "none"
    out = Path(args.out) if args.out else default_result_path(
        f"w3-{name}", payload["environment"].get("gpu"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=2))
    from bench.serve_report import render_markdown
    md = render_markdown([payload])
    md_path = Path(args.markdown) if args.markdown else out.with_suffix(".md")
    md_path.write_text(md)
    print(md)
    print(f"[serve_bench] wrote {out} and {md_path}")
    return 0


def offline_level(engine, prompts, params, c: int, n: int, time_left=None) -> dict:
    """One closed-loop level on the engine in-process (no HTTP): c requests in flight, a
    new one as each finishes, until n. time_left(): seconds left, or None for no limit;
    when it runs out, the requests still running are aborted and counted as failures."""
    ms = lambda x: None if x is None else round(1000 * x, 2)  # noqa: E731
    sent = 0
    start_of, first_of, last_of = {}, {}, {}
    ttfts, itls, tpots, latencies = [], [], [], []
    out_tokens = 0

    def add() -> None:
        nonlocal sent
        rid = engine.add_request(prompts[sent % len(prompts)], params)
        start_of[rid] = time.perf_counter()
        sent += 1

    start = time.perf_counter()
    while sent < min(c, n):
        add()
    cut = False
    while engine.has_unfinished_requests():
        if time_left is not None and time_left() < 0 and not cut:  # abort the rest: keep what finished
            cut = True
            for rid in list(start_of):
                engine.abort_request(rid)  # False for those already finished
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            rid = o.request_id
            ntok = len(o.outputs[0].token_ids)
            prev = last_of.get(rid)
            if prev is None and ntok:
                first_of[rid] = now - start_of[rid]
                ttfts.append(first_of[rid])
                last_of[rid] = (ntok, now)
            elif prev is not None and ntok > prev[0]:
                itls.append(now - prev[1])
                last_of[rid] = (ntok, now)
            if o.finished and not cut:
                latencies.append(now - start_of[rid])
                out_tokens += ntok
                if ntok > 1 and rid in first_of:
                    tpots.append((latencies[-1] - first_of[rid]) / (ntok - 1))
                if sent < n:
                    add()
    wall = time.perf_counter() - start
    return {
        "concurrency": c, "num_requests": n, "completed": len(latencies),
        "failures": n - len(latencies), "errors": ["cut off by the time budget"] if cut else [],
        "duration_s": round(wall, 3), "output_tokens": out_tokens,
        "output_tok_per_s": round(out_tokens / wall, 2) if wall > 0 else None,
        "requests_per_s": round(len(latencies) / wall, 3) if wall > 0 else None,
        "ttft_ms_p50": ms(percentile(ttfts, 50)), "ttft_ms_p99": ms(percentile(ttfts, 99)),
        "itl_ms_p50": ms(percentile(itls, 50)), "itl_ms_p99": ms(percentile(itls, 99)),
        "tpot_ms_mean": ms(sum(tpots) / len(tpots)) if tpots else None,
        "latency_s_p50": round(percentile(latencies, 50), 3) if latencies else None,
        "tokens_per_event": None,
    }


def run_offline_minivllm(args, prompts_for) -> dict:
    """The same closed loop on minivllm's LLMEngine in this process: `c` requests in
    flight, a new one added as soon as one finishes; TTFT and ITL from the moments outputs
    come out of engine.step()."""
    from minivllm.engine.llm_engine import LLMEngine
    from minivllm.sampling_params import SamplingParams
    from minivllm.server.launch import add_serve_arguments, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    eargs = parser.parse_args(shlex.split(args.minivllm_args) + (
        ["--model", args.model_path] if args.model_path else []))
    engine = LLMEngine(engine_config_from_args(eargs))
    t = Target(label="minivllm-offline", kind="minivllm")
    warm_prompts, level_prompts = split_prompts(prompts_for(t), args)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_tokens, ignore_eos=True)
    for prompt in warm_prompts:
        engine.add_request(prompt, SamplingParams(max_tokens=8, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
    levels = []
    for c, n, prompts in zip(args.concurrency, level_sizes(args), level_prompts):
        levels.append({**offline_level(engine, prompts, params, c, n), "peak_gpu_mem_gib": None})
        print(f"[serve_bench] {t.label:16s} c={c:<4d} {levels[-1]['output_tok_per_s']!s:>9} "
              f"tok/s  TTFT p50 {levels[-1]['ttft_ms_p50']} ms  ITL p50 "
              f"{levels[-1]['itl_ms_p50']} ms", flush=True)
    return {"label": t.label, "kind": "offline", "base_url": None,
            "model": str(engine.model_path), "launch_cmd": None,
            "info": {"engine_args": args.minivllm_args}, "levels": levels}


def _run_one(t: Target, args, prompts_for, headers) -> dict:
    print(f"[serve_bench] target {t.label} ({t.kind}) at {t.base_url}, model {t.model}",
          flush=True)
    levels = asyncio.run(bench_target(t, args, prompts_for, headers))
    return {"label": t.label, "kind": t.kind, "base_url": t.base_url, "model": t.model,
            "launch_cmd": shlex.join(t.launch_cmd) if t.launch_cmd else None,
            "info": t.info, "levels": levels}


if __name__ == "__main__":
    sys.path.insert(0, str(BENCH_DIR.parent))
    raise SystemExit(main())
