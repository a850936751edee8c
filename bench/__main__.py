"""`python -m bench COMMAND [ARGS...]`: the benchmark harness's one entry point.

Commands (each a thin wrapper; `python -m bench COMMAND --help` shows its flags):
  report        Markdown report + PNG plots from committed JSON alone (no GPU)   bench.report
  gpu-check     correctness, W1, W2, decode sweep, HF generate peers (GPU)     bench.gpu_check
  serve         W3 HTTP client against any OpenAI-compatible server(s)        bench.serve_bench
  serve-report  Markdown tables from serve JSON files                        bench.serve_report
  frontend-cpu  the HTTP frontend's CPU per streamed request and chunk (CPU)  bench.frontend_cpu
  frontend-micro  the same in one process: app + frontend, fake engine    bench.frontend_micro
  w3-gpu        budgeted W3 parts for the H200 (minivllm, offline, HF serve)     bench.w3_gpu
  w4            W4 on the CPU: SmolLM2-135M, minivllm vs HF generate             bench.w4_cpu
  w7            W7 speculative decoding on SmolLM2-135M (CPU or GPU)            bench.w7_spec
  quant-accuracy  each quantization's perplexity and agreement on SmolLM2   bench.quant_accuracy
  kv-fp8        the fp8 KV cache's capacity and decode step time (GPU)      bench.kv_cache_fp8
  kernels       Triton kernels vs the torch reference, speed (CUDA)       bench/kernel_check.py
  lm-eval       lm-eval local-completions against minivllm serve (CPU)   bench.lm_eval_check
  w3-gpu-run    W3 on a GPU in one call (W3_SMOKE=1: on a CPU)          bench/run_w3_gpu.sh
  offline-ab    minivllm variants on W1/W2/W5/W6, fresh processes, interleaved  bench.offline_ab

Examples:
  python -m bench report
  python -m bench serve --base-url http://127.0.0.1:8000/v1 --kind vllm --label vllm
  python -m bench gpu-check --sections w2,sweep --out-dir /tmp/gpu
  python -m bench w3-gpu-run minivllm offline
"""

from __future__ import annotations

import importlib
import os
import runpy
import subprocess
import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent

# name -> (module with main(argv) / a script, how it takes its arguments)
COMMANDS = {
    "report": ("bench.report", "argv"),
    "serve": ("bench.serve_bench", "argv"),
    "serve-report": ("bench.serve_report", "argv"),
    "frontend-cpu": ("bench.frontend_cpu", "argv"),
    "frontend-micro": ("bench.frontend_micro", "argv"),
    "w3-gpu": ("bench.w3_gpu", "argv"),
    "gpu-check": ("bench.gpu_check", "sys.argv"),
    "w4": ("bench.w4_cpu", "sys.argv"),
    "w7": ("bench.w7_spec", "sys.argv"),
    "quant-accuracy": ("bench.quant_accuracy", "sys.argv"),
    "kv-fp8": ("bench.kv_cache_fp8", "sys.argv"),
    "kernels": (str(BENCH_DIR / "kernel_check.py"), "script"),
    "lm-eval": ("bench.lm_eval_check", "argv"),
    "w3-gpu-run": (str(BENCH_DIR / "run_w3_gpu.sh"), "bash"),
    "offline-ab": ("bench.offline_ab", "argv"),
}


def usage(code: int) -> int:
    print(__doc__.strip())
    return code


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        return usage(0)
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"unknown command {name!r}\n", file=sys.stderr)
        return usage(2)
    target, style = COMMANDS[name]
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    src = REPO / "src"
    if src.is_dir() and str(src) not in sys.path:
        sys.path.insert(0, str(src))  # minivllm from this checkout when not installed
    if style == "bash":
        return subprocess.call(["bash", target, *rest])
    sys.argv = [f"python -m bench {name}", *rest]  # for argparse's usage lines
    if style == "script":
        runpy.run_path(target, run_name="__main__")
        return 0
    module = importlib.import_module(target)
    if style == "argv":
        return int(module.main(rest) or 0)
    return int(module.main() or 0)  # modules whose main() parses sys.argv


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
