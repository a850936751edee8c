"""kv_cache_dtype="fp8" against the model-dtype KV cache: capacity and decode-step time.

For each cache dtype, one engine (dummy weights, the model config given): the KV pool's
tokens in the same memory, then decode steps at each (batch, context) point replayed
through the engine's CUDA graphs over block tables of that context (the step's time
includes the host's input staging, the logits and the argmax, as in bench.gpu_check's
sweep). The issue's point is batch 64 at context 8192.
Usage: python -m bench.kv_cache_fp8 [--model llama-3.1-8b] [--points 1x8192,64x1024,64x8192]
       [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from bench.common import print_table, write_result

CONFIGS = Path(__file__).parent / "model_configs"


def step_ms(graph_runner, batch: int, context: int, block_size: int, iters: int) -> float:
    import torch

    per_seq = -(-context // block_size)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
    args = ([7] * batch, [context] * batch, tables)
    for _ in range(3):
        graph_runner.run(*args)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        graph_runner.run(*args)
    torch.cuda.synchronize()
    return 1000 * (time.perf_counter() - start) / iters


def measure(model: str, kv: str, points: list[tuple[int, int]], iters: int) -> list[dict]:
    from minivllm import LLM

    max_batch = max(b for b, _ in points)
    max_ctx = max(c for _, c in points)
    llm = LLM(str(CONFIGS / f"{model}.json"), load_format="dummy", dtype="bfloat16",
              skip_tokenizer_init=True, seed=0, kv_cache_dtype=kv,
              max_model_len=max_ctx + 16, max_num_seqs=max_batch, gpu_memory_utilization=0.9)
    runner = llm.engine.runner
    bs = llm.engine.config.block_size
    rows = []
    for batch, context in points:
        ms = step_ms(runner.graph_runner, batch, context, bs, iters)
        rows.append({"kv_cache_dtype": kv, "batch": batch, "context": context,
                     "ms_per_step": round(ms, 3), "kv_cache_tokens": runner.num_blocks * bs,
                     "kv_cache_gb": round(runner.kv_cache.nbytes / 1e9, 2)})
        print(rows[-1], file=sys.stderr, flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--points", default="1x8192,64x1024,64x8192")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a child's cache dtype
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    points = [tuple(int(v) for v in p.split("x")) for p in args.points.split(",")]
    if args.one:
        print(json.dumps(measure(args.model, args.one, points, args.iters)))
        return
    rows = []
    for kv in ("auto", "fp8"):  # each in a process of its own: the GPU's memory back after
        out = subprocess.run([sys.executable, "-m", "bench.kv_cache_fp8", "--model", args.model,
                              "--points", args.points, "--iters", str(args.iters), "--one", kv],
                             check=True, stdout=subprocess.PIPE, text=True).stdout
        rows += json.loads(out.strip().splitlines()[-1])
    base = {(r["batch"], r["context"]): r["ms_per_step"] for r in rows
            if r["kv_cache_dtype"] == "auto"}
    for r in rows:
        r["vs_auto"] = round(r["ms_per_step"] / base[(r["batch"], r["context"])], 3)
    print_table(rows, list(rows[0]))
    path = write_result("kv-cache-fp8", {"model": args.model, "dtype": "bfloat16",
                                         "points": args.points, "rows": rows}, args.out)
    print("wrote", path)


if __name__ == "__main__":
    main()
