"""Shared benchmark plumbing: environment facts, result files, tables."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def git_commit() -> str:
    # The GPU machine's copy of the tree carries a .git whose HEAD is not ours: the device
    # scripts export MINIVLLM_GIT_COMMIT from bench/.commit (written before the call).
    if os.environ.get("MINIVLLM_GIT_COMMIT"):
        return os.environ["MINIVLLM_GIT_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"],
                                       cwd=Path(__file__).parent, text=True,
                                       stderr=subprocess.DEVNULL).strip()
    except Exception:
        return "unknown"


def environment() -> dict:
    import torch

    env = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "git_commit": git_commit(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
    }
    for mod in ("transformers", "triton"):
        try:
            env[mod] = __import__(mod).__version__
        except Exception:
            env[mod] = None
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
        env["cuda"] = torch.version.cuda
    else:
        env["gpu"] = None
    return env


def machine_tag(gpu: str | None) -> str:
    """"h200" for "NVIDIA H200" (the GPU's model, short, lower-case), "cpu" without one."""
    if not gpu:
        return "cpu"
    words = str(gpu).split(",")[0].lower().replace("nvidia", "").split()
    return next((w for w in words if any(ch.isdigit() for ch in w)), words[0] if words
                else "gpu")


def default_result_path(name: str, gpu: str | None) -> Path:
    """bench/results/<date>-<machine>-<name>/<name>.json: result folders are named by date
    and by what they hold."""
    return RESULTS_DIR / f"{time.strftime('%Y-%m-%d')}-{machine_tag(gpu)}-{name}" / f"{name}.json"


def write_result(name: str, payload: dict, out: str | None = None) -> Path:
    env = environment()
    path = Path(out) if out else default_result_path(name, env.get("gpu"))
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": name, "environment": env, **payload}
    path.write_text(json.dumps(payload, indent=2))
    return path


def print_table(rows: list[dict], columns: list[str]) -> None:
    widths = [max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).ljust(w) for c, w in zip(columns, widths)))


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:,.2f}"
    return str(v)


def median_gpu_us(fn, reps: int = 50, warmup: int = 5) -> float:
    """Median microseconds of fn() on the GPU over reps calls (after warmup ones), each
    timed by CUDA events."""
    import statistics

    import torch
    times = []
    for _ in range(warmup + reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times[warmup:])
