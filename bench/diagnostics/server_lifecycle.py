"""A `minivllm serve` process group's life, timed: start to /health, streams, /metrics over
fresh connections (with several API processes every scrape must count every request and
show one engine token count), then SIGINT to the group and when each process ended.
Checks the server's lifecycle where a benchmark does not look: start-up with the extra
API processes, shutdown with streams just finished, metrics across processes.

    python -m bench.diagnostics.server_lifecycle --model DIR_OR_CONFIG --out FILE.json \\
        [--streams 64] [--scrapes 8] -- [minivllm serve flags, e.g. --api-servers 2]

The model is a folder (with a tokenizer), or a config.json with `--load-format dummy`
among the serve flags. Writes one JSON; exits 1 if a check failed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from bench.common import environment
from bench.serve_bench import parse_prometheus
from minivllm.server.testing import wait_until_healthy


def _group(pgid: int) -> dict[int, str]:
    """The running processes of a process group: pid -> name."""
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getpgid(int(entry)) == pgid:
                    found[int(entry)] = Path(f"/proc/{entry}/comm").read_text().strip()
            except (OSError, ProcessLookupError):
                pass
    return found


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--scrapes", type=int, default=8)
    p.add_argument("--start-timeout", type=float, default=300)
    p.add_argument("serve_flags", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    flags = [f for f in args.serve_flags if f != "--"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    log_path = Path(args.out).with_suffix(".server.log")
    cmd = [sys.executable, "-m", "minivllm.server", "--model", args.model, "--port",
           str(port), "--log-level", "info", "--disable-log-requests", *flags]
    result: dict = {"benchmark": "server_lifecycle", "environment": environment(),
                    "command": cmd, "checks": {}}
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        wait_until_healthy(url, proc, args.start_timeout)
        result["ready_s"] = round(time.monotonic() - t0, 2)
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        failures = []

        def stream(i: int) -> None:
            body = {"model": model, "prompt": f"Stream {i}: once upon a time",
                    "max_tokens": args.max_tokens, "stream": True, "ignore_eos": True}
            try:
                with httpx.Client(timeout=120) as c, \
                        c.stream("POST", url + "/v1/completions", json=body) as r:
                    lines = list(r.iter_lines())
                if r.status_code != 200 or "data: [DONE]" not in lines:
                    failures.append(f"stream {i}: HTTP {r.status_code}")
            except httpx.HTTPError as e:
                failures.append(f"stream {i}: {e!r}")

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(args.streams)]
        start = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        result["streams_s"] = round(time.monotonic() - start, 2)
        result["stream_failures"] = failures[:5]
        scrapes = []
        for _ in range(args.scrapes):
            m = parse_prometheus(httpx.get(url + "/metrics",
                                           headers={"Connection": "close"}).text, "minivllm:")
            scrapes.append({"requests": m.get("request_success_total"),
                            "ttft_count": m.get("time_to_first_token_seconds_count"),
                            "generation_tokens": m.get("generation_tokens_total"),
                            "running": m.get("num_requests_running")})
        result["scrapes"] = scrapes
        result["checks"]["streams_ok"] = not failures
        result["checks"]["every_scrape_counts_every_request"] = all(
            s["requests"] == args.streams and s["ttft_count"] == args.streams for s in scrapes)
        result["checks"]["one_engine_token_count"] = len(
            {s["generation_tokens"] for s in scrapes}) == 1
        result["checks"]["nothing_running"] = all(s["running"] == 0 for s in scrapes)
        names = _group(proc.pid)
        result["processes"] = {str(k): v for k, v in names.items()}
        sigint = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        ended: dict[int, float] = {}
        while len(ended) < len(names) and time.monotonic() - sigint < 60:
            for pid in names:
                if pid not in ended and not _alive(pid):
                    ended[pid] = round(time.monotonic() - sigint, 2)
            proc.poll()
            time.sleep(0.02)
        result["ended_after_sigint_s"] = {f"{pid} {names[pid]}": s for pid, s in ended.items()}
        result["exit_code"] = proc.wait(10) if proc.poll() is None else proc.returncode
        log_text = log_path.read_text(errors="replace")
        result["checks"]["every_process_ended"] = len(ended) == len(names)
        result["checks"]["clean_exit"] = result["exit_code"] == 0
        result["checks"]["no_engine_died_message"] = "engine process died" not in log_text
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result.get(k) for k in ("ready_s", "streams_s", "checks",
                                                 "ended_after_sigint_s")}))
    return 0 if all(result["checks"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
