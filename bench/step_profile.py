"""Where a workload's GPU time goes: torch.profiler over one offline run of a vs-vLLM
workload (bench/vs_vllm.py's shapes, fewer requests), kernels grouped by name.

    python -m bench.step_profile --model qwen3-0.6b --workload W5 --requests 8 --out FILE
    python -m bench.step_profile --model qwen2.5-0.5b-instruct --workload W1 --requests 256 \
        --sampling greedy temperature --out DIR/w1.json   # one file per setting: w1_temperature.json

Writes the wall time, the summed kernel time (the GPU's busy time; the rest is the host
or idle gaps), and the top kernels with their share, calls and time per call.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from bench.common import environment
from bench.vs_vllm import SAMPLING, MinivllmEngine, model_folder, row_name, sync
from bench.workloads import workloads


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--workload", default="W5")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--quantization", default=None, help="e.g. fp8, int4 (minivllm's names)")
    ap.add_argument("--block-size", type=int, default=None, help="KV-cache block size")
    ap.add_argument("--sampling", nargs="+", default=["greedy"], choices=sorted(SAMPLING),
                    help="bench/vs_vllm.py's settings, each profiled in turn on one engine")
    ap.add_argument("--work", default="/tmp/minivllm-profile")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    folder, cfg = model_folder(args.model, False, Path(args.work))
    w = workloads(False, cfg["vocab_size"])[args.workload.upper()]
    engine = MinivllmEngine(folder, False, quantization=args.quantization,
                            block_size=args.block_size)
    engine.generate(w.warm_up())
    for sampling in args.sampling:
        out = Path(args.out)
        if sampling != "greedy":
            out = out.with_name(f"{out.stem}_{sampling}{out.suffix}")
        profile_one(engine, w, sampling, args, out)


def profile_one(engine, w, sampling: str, args, out: Path) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    engine.generate(w.requests(0, args.requests), sampling)  # every shape compiled, warm
    reqs = w.requests(1, args.requests)
    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        engine.generate(reqs, sampling)
        sync()
        wall = time.perf_counter() - start
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e.name, []).append(e.device_time_total / 1e3)  # ms
    busy = sum(sum(v) for v in by_name.values())
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:args.top]
    rows = [{"kernel": k[:160], "ms": round(sum(v), 3), "share": round(sum(v) / busy, 4),
             "calls": len(v), "us_per_call": round(1e3 * sum(v) / len(v), 2)} for k, v in top]
    tokens = sum(len(p) for p, _ in reqs) + sum(o for _, o in reqs)
    record = {"benchmark": "step_profile", "model": args.model, "workload": args.workload,
              "sampling": sampling, "quantization": args.quantization,
              "requests": len(reqs), "tokens": tokens, "wall_ms": round(wall * 1e3, 2),
              "kernel_ms": round(busy, 2), "gpu_busy": round(busy / (wall * 1e3), 3),
              "environment": environment(), "top_kernels": rows}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1))
    print(f"{args.model} {row_name(args.workload, sampling)} x{len(reqs)}: wall "
          f"{wall * 1e3:.1f} ms, kernels {busy:.1f} ms ({100 * busy / (wall * 1e3):.0f}% busy)")
    for r in rows[:12]:
        print(f"  {100 * r['share']:5.1f}%  {r['ms']:8.2f} ms  x{r['calls']:<5d} "
              f"{r['us_per_call']:8.1f} us  {r['kernel'][:90]}")


if __name__ == "__main__":
    main()
