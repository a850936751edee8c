"""Decode-step time by batch size (CUDA): one engine (dummy weights, a model config from
bench/model_configs, optionally quantized), its decode CUDA graphs replayed at each
(batch, context) point as bench.kv_cache_fp8 does (host staging, logits and argmax
included). For a change that acts at some batch sizes only (e.g. a projection kernel
routed by rows), run it in two processes and compare.

    python -m bench.diagnostics.decode_steps --out FILE [--model llama-3.1-8b]
        [--quantization fp8] [--points 16x1024,64x1024,...] [--label NAME]
"""

from __future__ import annotations

import argparse
import json

from bench.common import environment
from bench.kv_cache_fp8 import CONFIGS, step_ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--points", default="1x1024,16x1024,32x1024,48x1024,64x1024,96x1024,"
                                        "128x1024,256x1024")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--label", default="")
    args = ap.parse_args()
    from minivllm import LLM

    points = [tuple(int(v) for v in p.split("x")) for p in args.points.split(",")]
    llm = LLM(str(CONFIGS / f"{args.model}.json"), load_format="dummy", dtype="bfloat16",
              skip_tokenizer_init=True, seed=0, quantization=args.quantization,
              max_model_len=max(c for _, c in points) + 16,
              max_num_seqs=max(b for b, _ in points), gpu_memory_utilization=0.9)
    runner = llm.engine.runner
    rows = []
    for batch, context in points:
        ms = step_ms(runner.graph_runner, batch, context, llm.engine.config.block_size,
                     args.iters)
        rows.append({"batch": batch, "context": context, "ms_per_step": round(ms, 3)})
        print(rows[-1], flush=True)
    with open(args.out, "w") as f:
        json.dump({"benchmark": "decode_steps", "model": args.model,
                   "quantization": args.quantization, "label": args.label,
                   "environment": environment(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
