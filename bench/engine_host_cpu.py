"""The engine loop's host time per step, device work excluded, for each sampling setting.

On a small model and many sequences the engine is limited by its host (docs/performance.md):
what a sampling setting adds to the host's part of a step costs as much as the GPU time it
adds. This runs an offline batch (W1's shape, shorter) through LLMEngine on the CPU, with a
tiny random Qwen2 of Qwen2.5's vocabulary, and subtracts the work that is the GPU's on a
GPU: the model's forward and logits, and the sampler's draw (replaced by an argmax, which is
timed with it). The rest is what the host does per step on any machine, here at this CPU's
speed. It also reports the sampler's host functions. On the CPU the sampling state is host
memory: an admission's writes to it (flush) count as host time, where on a GPU they are
copies and kernels queued behind the step.

    OMP_NUM_THREADS=1 python -m bench.engine_host_cpu --sampling greedy temperature --out x.json
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

from bench.common import environment
from bench.vs_vllm import SAMPLING, sampling_fields

DEVICE = [0.0]    # seconds of device work in the step being measured
_depth = [0]


def device_work(fn):
    """fn, its time counted as device work (not the host's; nested calls once)."""
    def timed(*args, **kwargs):
        if _depth[0]:
            return fn(*args, **kwargs)
        _depth[0] += 1
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            DEVICE[0] += time.perf_counter() - start
            _depth[0] -= 1
    return timed


def host_timed(obj, name: str, totals: dict) -> None:
    """Accumulate obj.name's host time (its device work subtracted) into totals[name]."""
    fn = getattr(obj, name)

    def timed(*args, **kwargs):
        start, device = time.perf_counter(), DEVICE[0]
        try:
            return fn(*args, **kwargs)
        finally:
            totals[name] += time.perf_counter() - start - (DEVICE[0] - device)
    setattr(obj, name, timed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sampling", nargs="+", default=["greedy", "temperature"],
                    choices=sorted(SAMPLING))
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    import torch

    import minivllm.worker.sampler as sampler_module
    from bench.gpu_check import SMOKE_CONFIG
    from minivllm.config import EngineConfig
    from minivllm.engine.llm_engine import LLMEngine
    from minivllm.sampling_params import SamplingParams

    torch.set_num_threads(1)
    folder = Path(tempfile.mkdtemp(prefix="engine-host-"))
    (folder / "config.json").write_text(json.dumps(dict(SMOKE_CONFIG, vocab_size=151936)))
    engine = LLMEngine(EngineConfig(model=str(folder), device="cpu", load_format="dummy",
                                    dtype="float32", max_num_seqs=args.requests,
                                    max_model_len=1024, skip_tokenizer_init=True))
    runner = engine.runner
    runner.setup_step_runners()
    runner.graph_runner.step_fn = device_work(runner.graph_runner.step_fn)
    runner.mixed_runner._forward = device_work(runner.mixed_runner._forward)
    runner.model.forward = device_work(runner.model.forward)
    runner.model.compute_logits = device_work(runner.model.compute_logits)
    sampler_module.sample_reference = device_work(
        lambda logits, state, rows, want_logprobs: (logits.argmax(-1), None))
    sampler_module.argmax_rows = device_work(sampler_module.argmax_rows)  # greedy rows
    totals: dict[str, float] = collections.defaultdict(float)
    for cls, name in ((sampler_module.Sampler, "sample"), (sampler_module.Sampler, "stage"),
                      (sampler_module.SamplingState, "slots_of"),
                      (sampler_module.SamplingState, "flush")):
        host_timed(cls, name, totals)

    def run(sampling: str) -> list[float]:
        rng = random.Random(0)
        for i in range(args.requests):
            params = SamplingParams(max_tokens=args.output_tokens, ignore_eos=True,
                                    **sampling_fields(sampling, i))
            ids = [rng.randrange(10, 150000) for _ in range(args.prompt_tokens)]
            engine.add_request(None, params, request_id=f"{sampling}-{i}", stream=False,
                               prompt_token_ids=ids)
        host = []
        while engine.has_unfinished_requests():
            DEVICE[0] = 0.0
            start = time.perf_counter()
            engine.step()
            host.append(time.perf_counter() - start - DEVICE[0])
        return host

    record = {"benchmark": "engine_host_cpu", "requests": args.requests,
              "prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens,
              "environment": environment(), "settings": {}}
    for sampling in args.sampling:
        run(sampling)  # warm
        totals.clear()
        host = run(sampling)
        row = {"steps": len(host), "host_ms_per_step_mean": round(statistics.mean(host) * 1e3, 3),
               "host_ms_per_step_median": round(statistics.median(host) * 1e3, 3),
               "sampler_us_per_step": {k: round(v / len(host) * 1e6, 1)
                                       for k, v in sorted(totals.items())}}
        record["settings"][sampling] = row
        print(f"{sampling:12s} host {row['host_ms_per_step_median']:.3f} ms/step (median), "
              f"{row['host_ms_per_step_mean']:.3f} mean; sampler {row['sampler_us_per_step']}",
              flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
