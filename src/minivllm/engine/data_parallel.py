"""Data parallelism: N engines, each in a process of its own, behind one frontend.

Each request goes whole (its n samples together) to the live engine with the fewest
requests in flight from this frontend; an engine that dies fails its own requests (its
AsyncLLMEngine ends their streams with an error) and takes no new ones, while the others
keep serving. On one GPU the engines share its memory (each gets its share of
gpu_memory_utilization). The server reads this object like an AsyncLLMEngine.
"""

from __future__ import annotations

import asyncio
import dataclasses

from ..config import EngineConfig
from .async_llm_engine import AsyncLLMEngine, EngineDeadError, RequestStream

# Snapshot entries that add up over the engines (the others are averaged).
_SUMMED = ("num_requests_running", "num_requests_waiting", "num_preemptions",
           "prefix_cache_queries", "prefix_cache_hits", "prompt_tokens", "generation_tokens",
           "num_unfinished", "spec_decode_num_drafts", "spec_decode_num_draft_tokens",
           "spec_decode_num_accepted_tokens")


class _StatLoggers(list):
    """The frontend's stat loggers: appended to every engine's list."""

    def __init__(self, replicas: list[AsyncLLMEngine]) -> None:
        super().__init__()
        self._replicas = replicas

    def append(self, logger) -> None:
        super().append(logger)
        for r in self._replicas:
            r.stat_loggers.append(logger)


class DataParallelEngine:
    def __init__(self, config: EngineConfig, size: int, *,
                 max_waiting_requests: int | None = None, start: bool = True) -> None:
        if size < 1:
            raise ValueError(f"data_parallel_size must be at least 1, got {size}.")
        share = dataclasses.replace(
            config, gpu_memory_utilization=config.gpu_memory_utilization / size)
        self.replicas = [AsyncLLMEngine(share, max_waiting_requests=max_waiting_requests,
                                        engine_process=True, start=False)
                         for _ in range(size)]
        self.stat_loggers = _StatLoggers(self.replicas)
        self.engine = None  # the engines live in other processes
        if start:
            self.start()

    def start(self, timeout: float | None = None) -> "DataParallelEngine":
        for r in self.replicas:  # the models load side by side
            r.launch()
        for r in self.replicas:
            r.start(timeout)
        return self

    # ---- facts, from the first engine (every engine serves the same model) --------------

    def __getattr__(self, name: str):
        if name in ("tokenizer", "model_path", "max_model_len", "vocab_size", "eos_token_ids",
                    "config", "output_codec"):
            return getattr(self.replicas[0], name)
        raise AttributeError(name)

    @property
    def is_running(self) -> bool:
        return any(r.is_running for r in self.replicas)

    @property
    def accepting(self) -> bool:
        return any(r.accepting for r in self.replicas)

    @property
    def num_in_flight(self) -> int:
        return sum(r.num_in_flight for r in self.replicas)

    # ---- requests -------------------------------------------------------------------------

    def pick(self) -> AsyncLLMEngine:
        """The live engine with the fewest of this frontend's requests in flight."""
        live = [r for r in self.replicas if r.accepting]
        if not live:
            raise EngineDeadError("No engine is running.")
        return min(live, key=lambda r: r.num_in_flight)

    async def add_requests(self, specs: list[dict]) -> list[RequestStream]:
        return await self.pick().add_requests(specs)

    def abort(self, request_id: str | list[str]) -> None:
        """Ids unknown to an engine are ignored there: every live engine is told."""
        for r in self.replicas:
            if r.is_running:
                r.abort(request_id)

    # ---- state -----------------------------------------------------------------------------

    @property
    def snapshot(self) -> dict:
        return merge_snapshots([r.snapshot for r in self.replicas if r.is_running])

    async def refresh_snapshot(self) -> dict:
        snaps = await asyncio.gather(*(r.refresh_snapshot() for r in self.replicas
                                       if r.is_running))
        return merge_snapshots(list(snaps))

    async def shutdown(self, drain_timeout: float = 0.0) -> None:
        await asyncio.gather(*(r.shutdown(drain_timeout) for r in self.replicas))

    def stop(self, timeout: float | None = 30.0) -> None:
        for r in self.replicas:
            r.stop(timeout)


def merge_snapshots(snaps: list[dict]) -> dict:
    """The engines' snapshots as one: counts summed, the KV-cache usage averaged; each
    engine's own under "engines"."""
    merged: dict = {"engines": snaps}
    for key in _SUMMED:
        if any(key in s for s in snaps):
            merged[key] = sum(s.get(key, 0) for s in snaps)
    usage = [s["kv_cache_usage"] for s in snaps if "kv_cache_usage" in s]
    if usage:
        merged["kv_cache_usage"] = sum(usage) / len(usage)
    return merged
