"""The HTTP frontend's CPU cost per streamed request and per streamed chunk, on any machine.

Launches `minivllm serve` on a tiny random model (bench.gpu_check's SMOKE_CONFIG, dummy
weights) with bench.w3_gpu's byte-level tokenizer, streams W3's requests at each
concurrency (/v1/completions, text prompts of --prompt-tokens characters = tokens,
--output-tokens forced with ignore_eos, greedy, stream_options.include_usage), and reads
the frontend process's CPU seconds from /proc before and after each level. The engine
runs in its own process, so the frontend's CPU per request and per chunk does not depend
on how fast the engine is; the client's view (tokens per SSE event, inter-token latency)
does, and on a small machine the client competes for the same cores.

    OMP_NUM_THREADS=1 python -m bench.frontend_cpu --concurrency 64 256 --out x.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

from bench import proc_cpu
from bench import serve_bench as sb


def prepare_model(folder: Path) -> Path:
    from bench.gpu_check import SMOKE_CONFIG
    from bench.w3_gpu import write_tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    if not (folder / "config.json").exists():
        (folder / "config.json").write_text(json.dumps(SMOKE_CONFIG, indent=1))
    if not (folder / "tokenizer.json").exists():
        write_tokenizer(folder, SMOKE_CONFIG["vocab_size"])
    return folder


def text_prompts(count: int, n_chars: int, seed: int) -> list[str]:
    import random

    from bench.w3_gpu import PROMPT_CHARS

    rng = random.Random(seed)
    return ["".join(rng.choice(PROMPT_CHARS) for _ in range(n_chars)) for _ in range(count)]


def cpu_of(snap: dict, pid: int) -> tuple[float, dict[str, float]]:
    """(process CPU seconds, {thread name: CPU seconds}) of one process in a snapshot."""
    p = snap[pid]
    threads: dict[str, float] = {}
    for name, cpu in p["threads"].values():
        threads[name] = threads.get(name, 0.0) + cpu
    return p["cpu_s"], threads


async def level(t: sb.Target, prompts: list[str], c: int, n: int, args) -> dict:
    pid = t.proc.pid
    before = proc_cpu.snapshot(pid)
    t0 = time.monotonic()
    lv = await sb.run_level(t, prompts, c, n, args.output_tokens, 600, {},
                            client_procs=args.client_procs)
    wall = time.monotonic() - t0
    after = proc_cpu.snapshot(pid)
    cpu0, th0 = cpu_of(before, pid)
    cpu1, th1 = cpu_of(after, pid)
    engine = [p for q, p in after.items() if q != pid and p["name"] == "minivllm-engine"]
    engine_cpu = None
    if engine:
        eng_pid = next(q for q, p in after.items() if p is engine[0])
        engine_cpu = round(after[eng_pid]["cpu_s"] - before.get(eng_pid, after[eng_pid])[
            "cpu_s"], 3)
    completed = lv["completed"] or 0
    events = round(lv["output_tokens"] / lv["tokens_per_event"]) if completed else 0
    frontend_s = cpu1 - cpu0
    lv.update({
        "frontend_cpu_s": round(frontend_s, 3),
        "frontend_cpu_share": round(frontend_s / wall, 2),
        "frontend_threads_cpu_s": {k: round(v - th0.get(k, 0.0), 3) for k, v in th1.items()
                                   if v - th0.get(k, 0.0) >= 0.01},
        "engine_cpu_s": engine_cpu,
        "token_events": events,
        "frontend_ms_per_request": round(1000 * frontend_s / max(1, completed), 3),
        "frontend_us_per_event": round(1e6 * frontend_s / max(1, events), 1),
    })
    return lv


def fmt(lv: dict) -> str:
    return (f"c={lv['concurrency']:>4} n={lv['completed']:>5} {lv['requests_per_s']:8.1f} req/s "
            f"{lv['output_tok_per_s']:9.0f} tok/s | frontend {lv['frontend_ms_per_request']:.2f} "
            f"ms/req {lv['frontend_us_per_event']:.0f} us/event share "
            f"{lv['frontend_cpu_share']:.2f} | tok/event {lv['tokens_per_event']} ITL p50 "
            f"{lv['itl_ms_p50']} p99 {lv['itl_ms_p99']} ms TTFT p50 {lv['ttft_ms_p50']} ms")


async def run(t: sb.Target, args) -> list[dict]:
    warm = text_prompts(args.warmup, args.prompt_tokens, args.seed + 1)
    await sb.run_level(t, warm, min(len(warm), 64), len(warm), 8, 120, {},
                       client_procs=args.client_procs)
    levels = []
    offset = 0
    for c in args.concurrency:
        n = max(c, int(round(args.rounds * c)))
        # fresh prompts per level: a prompt seen before would skip its prefill (prefix cache)
        prompts = text_prompts(offset + n, args.prompt_tokens, args.seed)[offset:]
        offset += n
        lv = await level(t, prompts, c, n, args)
        print("[frontend_cpu]", fmt(lv), flush=True)
        levels.append(lv)
    return levels


def launch(folder: Path, args) -> sb.Target:
    import subprocess

    port = sb.free_port()
    cmd = [sys.executable, "-m", "minivllm.server", "--host", "127.0.0.1", "--port", str(port),
           "--disable-log-requests", "--log-level", "warning", "--model", str(folder),
           "--load-format", "dummy", "--seed", "0", *shlex.split(args.minivllm_args)]
    t = sb.Target(label="minivllm", kind="minivllm", base_url=f"http://127.0.0.1:{port}/v1",
                  launch_cmd=cmd, log_path=Path(args.work) / f"server-{port}.log")
    env = dict(os.environ, HF_HUB_DISABLE_UPDATE_CHECK="1")
    env.setdefault("OMP_NUM_THREADS", "1")
    print(f"[frontend_cpu] launching: {shlex.join(cmd)}", flush=True)
    t.proc = subprocess.Popen(cmd, stdout=open(t.log_path, "w"), stderr=subprocess.STDOUT,
                              env=env, start_new_session=True)
    sb.wait_healthy(t, 300)
    return t


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[64, 256])
    p.add_argument("--rounds", type=float, default=2.0)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--warmup", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--client-procs", type=int, default=1)
    p.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "minivllm-frontend-cpu"))
    p.add_argument("--minivllm-args", default="--max-model-len 512 --max-num-seqs 256",
                   help="Extra flags for `minivllm serve`.")
    p.add_argument("--out", default=None, help="Write the levels as JSON here.")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    folder = prepare_model(Path(args.work) / "smoke-qwen2-bytes")
    t = launch(folder, args)
    try:
        sb.discover(t, {})
        levels = asyncio.run(run(t, args))
    finally:
        sb.stop_target(t)
        sb.close_client_pools()
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({
            "benchmark": "frontend_cpu", "command": shlex.join([sys.executable, "-m",
                                                                 "bench.frontend_cpu",
                                                                 *(argv or sys.argv[1:])]),
            "environment": sb.environment(), "git_commit": sb.git_commit(),
            "server_cmd": shlex.join(t.launch_cmd), "levels": levels}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
