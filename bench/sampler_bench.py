"""The sampler alone on a GPU: microseconds per step for each sampling setting and batch,
replayed as the engine replays it (one CUDA graph per row bucket), beside the greedy
argmax the decode graph computes anyway.

    python -m bench.sampler_bench [--vocab 151936 128256] [--rows 1 16 64 256] --out F.json

Logits are random bf16 rows (scale 4: a peaked distribution like a trained model's; scale
0.3: a flat one like dummy weights') at a real vocabulary's size; every row of a batch has
the same setting, its own seed, and a 200-token prompt and 100-token output counted for
its penalties.
"""

from __future__ import annotations

import argparse
import gc
import json
from pathlib import Path

import torch

from bench.common import environment, median_gpu_us
from minivllm import SamplingParams
from csrc_triton import sampling as K
from minivllm.worker import sampler as S

SETTINGS = {
    "greedy + repetition 1.1": dict(temperature=0.0, repetition_penalty=1.1),
    "temperature 0.8": dict(temperature=0.8),
    "top_k 50": dict(temperature=0.8, top_k=50),
    "top_p 0.95": dict(temperature=0.8, top_p=0.95),
    "min_p 0.05": dict(temperature=0.8, min_p=0.05),
    "W1 sampled": dict(temperature=0.8, top_p=0.95, top_k=50, repetition_penalty=1.1),
    "Qwen2.5 defaults": dict(temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05),
    "Llama 3.1 defaults": dict(temperature=0.6, top_p=0.9),
    "W1 sampled + logprobs 5": dict(temperature=0.8, top_p=0.95, top_k=50,
                                    repetition_penalty=1.1, logprobs=5),
}


class Seq:
    def __init__(self, i: int, vocab: int, params: SamplingParams) -> None:
        g = torch.Generator().manual_seed(i)
        self.seq_id, self.params = i, params
        self.params._eos_token_ids = frozenset([2])
        self.prompt_token_ids = torch.randint(0, vocab, (200,), generator=g).tolist()
        self.output_token_ids = torch.randint(0, vocab, (100,), generator=g).tolist()
        self.num_prompt_tokens = 200
        self.plain_greedy = False


def kernel_times(fn, reps: int = 10) -> dict[str, float]:
    """Each kernel's mean device microseconds per call of fn (graph replays included)."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    times: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            name = e.name.split("(")[0][:40]
            times[name] = times.get(name, 0.0) + e.device_time / reps
    return {k: round(v, 1) for k, v in sorted(times.items(), key=lambda kv: -kv[1])}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--vocab", type=int, nargs="+", default=[151936])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256])
    p.add_argument("--scales", type=float, nargs="+", default=[4.0, 0.3])
    p.add_argument("--out", required=True)
    p.add_argument("--profile", action="store_true",
                   help="also each kernel's device time per replay (torch.profiler)")
    p.add_argument("--programs-per-sm", type=int, nargs="+", default=None,
                   help="measure each of these targets of the kernels' programs per SM "
                        "(csrc_triton.sampling.PROGRAMS_PER_SM; default: its value)")
    args = p.parse_args()
    record = {"benchmark": "sampler", "environment": environment(), "rows": []}
    for programs in args.programs_per_sm or [K.PROGRAMS_PER_SM]:
        K.PROGRAMS_PER_SM = programs
        K.sampling_splits.cache_clear()
        measure(args, record, programs)
    Path(args.out).write_text(json.dumps(record, indent=1))
    return 0


def measure(args, record: dict, programs: int) -> None:
    dev = torch.device("cuda")
    for vocab in args.vocab:
        most = max(args.rows)
        logits = torch.empty(most, vocab, dtype=torch.bfloat16, device=dev)
        greedy = torch.empty(most, dtype=torch.long, device=dev)
        argmax_graphs = {}
        for n in args.rows:
            S.argmax_rows(logits[:n], greedy[:n])
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                S.argmax_rows(logits[:n], greedy[:n])
            argmax_graphs[n] = graph
        for scale in args.scales:
            g = torch.Generator(device=dev).manual_seed(0)  # the same rows every run
            logits.copy_(torch.randn(most, vocab, device=dev, generator=g) * scale)
            for n in args.rows:
                base = median_gpu_us(argmax_graphs[n].replay)
                record["rows"].append({"vocab": vocab, "scale": scale, "rows": n,
                                       "setting": "greedy argmax", "us": round(base, 1)})
                print(f"V={vocab} scale={scale} rows={n:4d} {'greedy argmax':26s} "
                      f"{base:8.1f} us", flush=True)
                for name, kw in SETTINGS.items():
                    sampler = S.Sampler(vocab, dev, seed=0, max_rows=most, num_slots=most)
                    sampler.graphs = S.SamplerGraphs(sampler, logits, greedy)
                    sampler.graphs.buckets = [n]
                    sampler.graphs.capture()
                    seqs = [Seq(i, vocab, SamplingParams(seed=i, **kw)) for i in range(n)]
                    lp_rows = sampler.stage(seqs, [300] * n, padded=n)
                    replay = sampler.graphs.graphs[n, bool(lp_rows), sampler.truncating,
                                                    sampler.searching].replay
                    us = median_gpu_us(replay)
                    row = {"vocab": vocab, "scale": scale, "rows": n, "setting": name,
                           "programs_per_sm": programs, "us": round(us, 1)}
                    if args.profile:
                        row["kernels_us"] = kernel_times(replay)
                        print("   ", row["kernels_us"], flush=True)
                    record["rows"].append(row)
                    print(f"V={vocab} scale={scale} rows={n:4d} P/SM={programs:2d} "
                          f"{name:26s} {us:8.1f} us", flush=True)
                    # Its graphs die here, not in a garbage collection that a later
                    # capture's allocations set off (a graph freed mid-capture breaks it).
                    del sampler, replay
                    gc.collect()
                    torch.cuda.empty_cache()


if __name__ == "__main__":
    raise SystemExit(main())
