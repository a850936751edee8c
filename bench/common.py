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


def write_result(name: str, payload: dict, out: str | None = None) -> Path:
    path = Path(out) if out else RESULTS_DIR / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": name, "environment": environment(), **payload}
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


def graph_replay_us(fn, n: int = 200, warm: int = 10) -> float:
    """Microseconds of device time per replay of a CUDA graph of fn (run once first, so
    Triton compiles outside the capture). Replays, not an eager loop: an eager loop of
    small kernels measures Python's launch overhead, not the GPU."""
    import torch

    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(warm):
        graph.replay()
    return replays_us(graph, n)


def replays_us(graph, n: int) -> float:
    """Microseconds of device time per replay of `graph`, n replays back to back."""
    import torch

    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return 1000 * start.elapsed_time(end) / n


W2_MODEL_CONFIG = "bench/model_configs/qwen2.5-0.5b-instruct.json"


def probe_llm(model_config: str = W2_MODEL_CONFIG):
    """The engine the W2 probes (w2_gap, replay_state) take apart: the Qwen2.5-0.5B config
    with dummy bf16 weights on the GPU, decode graphs for batches up to 8. Returns
    (llm, its decode graph runner, its block size)."""
    from minivllm import LLM

    llm = LLM(model_config, load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True,
              device="cuda", seed=0, max_model_len=2048, max_num_seqs=8)
    return llm, llm.engine.runner.graph_runner, llm.engine.config.block_size


def gpu_probe_parser(doc: str, model_config: bool = False):
    """The command line every GPU probe shares: --out FILE (and --model-config)."""
    import argparse

    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    if model_config:
        ap.add_argument("--model-config", default=W2_MODEL_CONFIG)
    return ap


def has_cuda(probe: str) -> bool:
    """False (and says so) on a machine without a CUDA device."""
    import torch

    if not torch.cuda.is_available():
        print(f"{probe}: no CUDA device")
        return False
    return True
