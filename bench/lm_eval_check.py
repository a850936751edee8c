"""lm-eval against `minivllm serve`, end to end, offline: does a real evaluation harness
work with minivllm's OpenAI server and its remote tokenizer (/tokenizer_info, /tokenize,
/detokenize)?

Starts `python -m minivllm.server` (the default model SmolLM2-135M-Instruct unless
--model) on a free port as a subprocess, waits for /health, runs lm-eval's
`local-completions` model with `tokenizer_backend=remote` and `tokenized_requests=True`
on the two tasks in bench/lm_eval_task/ (a multiple-choice task scored by loglikelihood,
and a generate_until task scored by exact match: small, written for this check, read from
local JSONL), prints lm-eval's results table, leaves its JSON (and both logs) under --out,
and stops the server with SIGINT.

    python -m bench.lm_eval_check                      # --out: a new folder under /tmp
    python bench/lm_eval_check.py --out /tmp/lm-eval-check
    python bench/lm_eval_check.py --out /tmp/x --lm-eval /path/to/lm_eval --limit 3

lm-eval is not a dependency of minivllm: it lives in a venv of its own (lm-eval 0.4.x with
the [api] extras; `make lm-eval` makes it in .venv/lm-eval, torch pinned to the local CPU
wheel, and runs this script). By default this script takes `lm_eval` from PATH, else
.venv/lm-eval/bin/lm_eval. Nothing is downloaded
(HF_HUB_OFFLINE=1, HF_DATASETS_OFFLINE=1; the tasks use datasets' built-in json loader).
Exit status: lm-eval's, or 1 when the server did not come up.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
TASK_DIR = BENCH_DIR / "lm_eval_task"
TASKS = ("minivllm_facts_mc", "minivllm_facts_gen")
DEFAULT_LM_EVAL = shutil.which("lm_eval") or str(REPO / ".venv" / "lm-eval" / "bin" / "lm_eval")
SERVED_NAME = "SmolLM2-135M-Instruct"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server did not answer /health within {timeout:.0f} s")
        time.sleep(0.5)


def stop_server(proc: subprocess.Popen, timeout: float = 30.0) -> int:
    """SIGINT (a graceful shutdown), then SIGKILL past `timeout`."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    return proc.returncode


def results_files(out: Path) -> list[Path]:
    return sorted(out.rglob("results_*.json"), key=lambda p: p.stat().st_mtime)


def summary(path: Path) -> str:
    data = json.loads(path.read_text())
    lines = []
    for task, metrics in sorted(data.get("results", {}).items()):
        shown = ", ".join(f"{k} {v:.3f}" for k, v in sorted(metrics.items())
                          if isinstance(v, float) and "stderr" not in k)
        lines.append(f"  {task}: {shown}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None,
                   help="Folder for lm-eval's results JSON, its log and the server's log "
                        "(default: a new folder under the system's temp folder).")
    p.add_argument("--lm-eval", default=DEFAULT_LM_EVAL,
                   help=f"The lm_eval executable (default {DEFAULT_LM_EVAL}).")
    p.add_argument("--model", default=None,
                   help="Model for the server (default: SmolLM2-135M-Instruct).")
    p.add_argument("--served-model-name", default=SERVED_NAME)
    p.add_argument("--port", type=int, default=0, help="Server port (default: a free one).")
    p.add_argument("--num-concurrent", type=int, default=4)
    p.add_argument("--limit", type=int, default=None, help="lm-eval --limit (per task).")
    p.add_argument("--start-timeout", type=float, default=300.0,
                   help="Seconds to wait for the server's /health.")
    p.add_argument("--server-arg", action="append", default=[],
                   help="One more flag for minivllm serve (repeatable), e.g. "
                        "--server-arg=--max-model-len=2048.")
    args = p.parse_args(argv)

    args.lm_eval = str(Path(args.lm_eval).resolve())  # lm-eval runs in another folder
    if not Path(args.lm_eval).exists():
        print(f"lm_eval not found at {args.lm_eval} (pass --lm-eval)", file=sys.stderr)
        return 2
    if args.out is None:
        out = Path(tempfile.mkdtemp(prefix="minivllm-lm-eval-"))
    else:
        out = args.out.resolve()
        out.mkdir(parents=True, exist_ok=True)
    port = args.port or free_port()
    base = f"http://127.0.0.1:{port}"

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    src = str(REPO / "src")  # minivllm from this checkout, installed or not
    server_env = {**env, "PYTHONPATH": os.pathsep.join(
        [src] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))}
    server_cmd = [sys.executable, "-m", "minivllm.server", "--port", str(port),
                  "--served-model-name", args.served_model_name,
                  "--disable-log-requests", *args.server_arg]
    if args.model:
        server_cmd += ["--model", args.model]
    server_log = open(out / "server.log", "wb")
    print("$", " ".join(server_cmd), flush=True)
    server = subprocess.Popen(server_cmd, stdout=server_log, stderr=subprocess.STDOUT,
                              env=server_env, cwd=REPO)
    rc = 1
    try:
        t0 = time.monotonic()
        try:
            wait_healthy(base, server, args.start_timeout)
        except RuntimeError as e:
            server_log.flush()
            tail = (out / "server.log").read_text(errors="replace")[-3000:]
            print(f"minivllm serve: {e}\n{tail}", file=sys.stderr)
            return 1
        print(f"server healthy after {time.monotonic() - t0:.1f} s on {base}", flush=True)

        model_args = ",".join([
            f"model={args.served_model_name}", f"base_url={base}/v1/completions",
            "tokenizer_backend=remote", f"num_concurrent={args.num_concurrent}",
            "max_retries=1", "tokenized_requests=True"])
        cmd = [args.lm_eval, "--model", "local-completions", "--model_args", model_args,
               "--tasks", ",".join(TASKS), "--include_path", str(TASK_DIR),
               "--output_path", str(out), "--log_samples", "--batch_size", "1",
               "--seed", "1234"]
        if args.limit is not None:
            cmd += ["--limit", str(args.limit)]
        print("$", " ".join(cmd), flush=True)
        t0 = time.monotonic()
        # The task YAMLs name their JSONL files relative to their folder.
        with open(out / "lm_eval.log", "wb") as log:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    env=env, cwd=TASK_DIR)
            assert proc.stdout is not None
            for line in proc.stdout:
                log.write(line)
                sys.stdout.buffer.write(line)
                sys.stdout.flush()
            rc = proc.wait()
        print(f"lm_eval exited with status {rc} after {time.monotonic() - t0:.1f} s",
              flush=True)
        files = results_files(out)
        if files:
            print(f"results JSON: {files[-1]}\n{summary(files[-1])}")
        elif rc == 0:
            print("lm_eval wrote no results JSON", file=sys.stderr)
            rc = 1
    finally:
        status = stop_server(server)
        server_log.close()
        print(f"server stopped (exit status {status}); its log: {out / 'server.log'}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
