"""Probe: why do some processes run W5 at two thirds the speed of others?

Seen on the H200 (bench/results/2026-12-02-h200-kv-blocks-64-tma/): whole processes of the
same tree ran Qwen3-0.6B's W5 at ~185k or ~290k prompt tok/s, every repetition of a
process at the same speed, and a slow process's GPU was busy only 54% of the time: the
host was the limit. This runs W5 in several fresh processes, one after another, and
records for each engine step its wall time, the main thread's CPU time (a slow host
thread on a busy or shared core shows as CPU time ~ wall time; waiting shows as less),
the runner's path (long steps launched ahead or not) and the CPU the thread ran on, plus
GC pauses and torch's thread count per process.

    python -m bench.diagnostics.w5_processes --model qwen3-0.6b --processes 6 --out FILE
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path


def _current_cpu() -> int:
    """The CPU the calling thread last ran on (field 39 of /proc/thread-self/stat)."""
    try:
        with open("/proc/thread-self/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[36])
    except (OSError, IndexError, ValueError):
        return -1


def one_process(model: str, block_size: int | None, reps: int, work: str,
                smoke: bool = False) -> dict:
    import torch

    from bench.vs_vllm import MinivllmEngine, model_folder, sync
    from bench.workloads import workloads

    folder, cfg = model_folder(model, smoke, Path(work))
    w = workloads(smoke, cfg["vocab_size"])["W5"]
    engine = MinivllmEngine(folder, smoke, block_size=block_size)
    core = engine.llm.engine
    gc_pauses: list = []
    started = [0.0]

    def on_gc(phase, info):
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            gc_pauses.append((info["generation"],
                              round(1e3 * (time.perf_counter() - started[0]), 2)))
    gc.callbacks.append(on_gc)
    steps: list = []
    plain_step = core.step

    def traced_step():
        t, c = time.perf_counter(), time.thread_time()
        out = plain_step()
        last = getattr(core.runner, "last_step", None)
        steps.append((last[0] if last else None, round(1e3 * (time.perf_counter() - t), 2),
                      round(1e3 * (time.thread_time() - c), 2), _current_cpu()))
        return out
    core.step = traced_step
    engine.generate(w.warm_up())
    record = {"pid": os.getpid(), "torch_threads": torch.get_num_threads(),
              "affinity": sorted(os.sched_getaffinity(0)), "reps": []}
    for rep in range(reps):
        reqs = w.requests(rep)
        steps.clear()
        gc_pauses.clear()
        sync()
        t = time.perf_counter()
        engine.generate(reqs)
        sync()
        secs = time.perf_counter() - t
        record["reps"].append({
            "prompt_tok_per_s": round(sum(len(p) for p, _ in reqs) / secs),
            "paths": dict(collections.Counter(s[0] for s in steps)),
            "step_wall_ms": [s[1] for s in steps], "step_cpu_ms": [s[2] for s in steps],
            "cpus": sorted(set(s[3] for s in steps)), "gc": gc_pauses[:]})
    return record


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--processes", type=int, default=6)
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--work", default="/tmp/minivllm-w5-processes")
    ap.add_argument("--smoke", action="store_true", help="a tiny model on the CPU")
    ap.add_argument("--out", required=True)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        json.dump(one_process(args.model, args.block_size, args.reps, args.work, args.smoke),
                  sys.stdout)
        return
    from bench.common import environment

    runs = []
    for i in range(args.processes):
        cmd = [sys.executable, "-m", "bench.diagnostics.w5_processes", "--child", "--model",
               args.model, "--reps", str(args.reps), "--work", args.work, "--out", "-"]
        if args.block_size:
            cmd += ["--block-size", str(args.block_size)]
        if args.smoke:
            cmd.append("--smoke")
        done = subprocess.run(cmd, capture_output=True, text=True)
        try:
            run = json.loads(done.stdout.strip().splitlines()[-1])
        except (IndexError, json.JSONDecodeError):
            run = {"error": done.stderr[-2000:]}
        runs.append(run)
        rates = [r["prompt_tok_per_s"] for r in run.get("reps", [])]
        print(f"[w5_processes] process {i}: {rates}", flush=True)
    Path(args.out).write_text(json.dumps({"benchmark": "w5_processes", "model": args.model,
                                          "block_size": args.block_size,
                                          "environment": environment(), "runs": runs},
                                         indent=1))


if __name__ == "__main__":
    main()
