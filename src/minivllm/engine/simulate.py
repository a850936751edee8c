"""`minivllm simulate TRAFFIC.json`: a traffic file replayed through the real engine loop
and scheduler with the model left out, for any model (a 70B config on a laptop): what is
admitted when, how prompts are chunked, what is preempted, how full the KV pool gets.

A traffic file is a JSON list of requests {"arrival_step": int, "prompt_tokens": int,
"output_tokens": int} (or {"requests": [...], ...engine settings}); each request gets
random prompt ids and runs to its output length (ignore_eos). The engine runs step by
step (no pipelining); the model's tokens are stand-ins, which no scheduling decision
depends on. `replay` drives an engine, real or simulated, and records each step's
decisions, so the two can be compared (tests/test_cli.py).
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass, field

from ..config import EngineConfig
from ..sampling_params import SamplingParams
from ..worker.model_runner import StepResult
from ..worker.sampler import SamplerOutput


@dataclass
class StepRecord:
    step: int
    scheduled: list[tuple[str, int]]   # (request id, tokens) in scheduling order
    admitted: list[str]
    preempted: list[str]
    running: int
    waiting: int
    blocks_used: int


@dataclass
class Timeline:
    num_blocks: int
    steps: list[StepRecord] = field(default_factory=list)

    def decisions(self) -> list[tuple]:
        """What the scheduler decided, step by step (for comparing two replays)."""
        return [(r.scheduled, r.admitted, r.preempted) for r in self.steps]


def load_traffic(path: str | os.PathLike) -> tuple[list[dict], dict]:
    """(requests, engine settings the file gives) of a traffic file."""
    with open(path) as f:
        data = json.load(f)
    settings = {}
    if isinstance(data, dict):  # keys starting with "_" are notes
        settings = {k: v for k, v in data.items()
                    if k != "requests" and not k.startswith("_")}
        data = data["requests"]
    for i, r in enumerate(data):
        for key in ("arrival_step", "prompt_tokens", "output_tokens"):
            if not isinstance(r.get(key), int) or r[key] < (0 if key == "arrival_step" else 1):
                raise ValueError(f"{path}: request {i} needs {key} as a whole number "
                                 f"({'>= 0' if key == 'arrival_step' else '>= 1'}).")
    return sorted(data, key=lambda r: r["arrival_step"]), settings


class _Sampler:
    """What the engine asks of a sampler, when there is none."""

    before_sample = None

    def release(self, seq) -> None:
        pass


class SimulatedRunner:
    """The ModelRunner's part the engine loop uses, without a model: every sampled row's
    token is the same stand-in id."""

    mixed_runner = None
    graph_runner = None

    def __init__(self, config: EngineConfig, model_config, device, num_blocks: int,
                 token: int = 3) -> None:
        self.num_blocks = num_blocks
        self.startup = {}
        self.sampler = _Sampler()
        self.token = token % model_config.vocab_size
        self.last_step = None

    def weight_bytes(self) -> int:
        return 0

    def quantization_label(self) -> str:
        return ""

    def can_launch_async(self, batch) -> bool:
        return False

    def execute(self, batch) -> StepResult:
        rows = [s for i, s in enumerate(batch.seqs) if batch.samples(i)]
        self.last_step = ("simulated", batch.num_tokens, len(batch.seqs))
        return StepResult(rows, SamplerOutput([self.token] * len(rows), []), [])


def replay(engine, requests: list[dict], seed: int = 0, max_steps: int = 1_000_000) -> Timeline:
    """Add each request at its arrival step, step until all are done; the timeline of the
    scheduler's decisions. The engine must run step by step (MINIVLLM_PIPELINE=0)."""
    rng = random.Random(seed)
    vocab = min(engine.vocab_size, 10_000)
    prompts = [[rng.randrange(10, vocab) for _ in range(r["prompt_tokens"])] for r in requests]
    sched = engine.scheduler
    timeline = Timeline(sched.pool.num_blocks)
    original = sched.schedule
    batches = []
    sched.schedule = lambda: batches.append(original()) or batches[-1]
    try:
        nxt = 0
        step = 0
        while (nxt < len(requests) or engine.has_unfinished_requests()) and step < max_steps:
            while nxt < len(requests) and requests[nxt]["arrival_step"] <= step:
                r = requests[nxt]
                engine.add_request(prompts[nxt], SamplingParams(
                    temperature=0.0, max_tokens=r["output_tokens"], ignore_eos=True),
                    request_id=f"r{nxt}", stream=False)
                nxt += 1
            batches.clear()
            before = {id(s) for s in sched.running}  # admitted: scheduled, not running before
            engine.step()
            for batch in batches:
                timeline.steps.append(StepRecord(
                    step, [(s.request.request_id, n) for s, n in zip(batch.seqs,
                                                                      batch.num_new_tokens)],
                    [s.request.request_id for s in batch.seqs if id(s) not in before],
                    [s.request.request_id for s in batch.preempted], len(sched.running),
                    len(sched.waiting), sched.pool.num_blocks - sched.pool.num_free))
            step += 1
    finally:
        sched.schedule = original
    return timeline


def simulated_engine(model: str, num_kv_blocks: int, **settings):
    """An LLMEngine over a SimulatedRunner: the model's config only (dummy, never built)."""
    from .llm_engine import LLMEngine
    cfg = EngineConfig(model=model, load_format="dummy", skip_tokenizer_init=True,
                       device="cpu", num_kv_blocks=num_kv_blocks, **settings)
    return LLMEngine(cfg, runner_factory=lambda c, m, d: SimulatedRunner(c, m, d,
                                                                          num_kv_blocks))


def step_lines(t: Timeline) -> list[str]:
    """One line a step: what ran (request:tokens), who came in, who was preempted."""
    lines = []
    for r in t.steps:
        ran = " ".join(f"{rid}:{n}" for rid, n in r.scheduled)
        extra = (f"  +{','.join(r.admitted)}" if r.admitted else "") + (
            f"  preempted {','.join(r.preempted)}" if r.preempted else "")
        lines.append(f"step {r.step:>4}  running {r.running:>3} waiting {r.waiting:>3} "
                     f"blocks {r.blocks_used:>5}/{t.num_blocks}  [{ran}]{extra}")
    return lines


def summary(t: Timeline) -> str:
    steps = len({r.step for r in t.steps})
    admitted = sum(len(r.admitted) for r in t.steps)
    preempted = sum(len(r.preempted) for r in t.steps)
    peak = max((r.blocks_used for r in t.steps), default=0)
    chunked = sum(1 for r in t.steps for _, n in r.scheduled if n > 1)
    return (f"{steps} steps, {admitted} admissions, {chunked} prefill chunks, {preempted} "
            f"preemptions; KV pool peak {peak} of {t.num_blocks} blocks")


def plot(t: Timeline, path: str) -> None:
    """Pool use, running and waiting sequences over the steps; preemptions marked."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    steps = [r.step for r in t.steps]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 5), sharex=True)
    top.plot(steps, [r.blocks_used for r in t.steps], label="KV blocks used")
    top.axhline(t.num_blocks, color="grey", linestyle=":", label="pool")
    for r in t.steps:
        if r.preempted:
            top.axvline(r.step, color="red", alpha=0.4)
    top.set_ylabel("blocks")
    top.legend(loc="upper right")
    bottom.plot(steps, [r.running for r in t.steps], label="running")
    bottom.plot(steps, [r.waiting for r in t.steps], label="waiting")
    bottom.bar(steps, [sum(n for _, n in r.scheduled) / 16 for r in t.steps], alpha=0.3,
               label="tokens / 16")
    bottom.set_xlabel("step (red: a preemption)")
    bottom.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
