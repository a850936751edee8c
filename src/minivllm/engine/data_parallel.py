"""Data parallelism: N engines, each in a process of its own, behind one frontend (the
server's DataParallelEngine), or splitting an offline generate() call (OfflineReplicas).

Each request goes whole (its n samples together) to the live engine with the fewest
requests in flight from this frontend, unless an engine that served a prompt starting with
the same PREFIX_TOKENS tokens is at most OVERLOAD requests busier (its prefix cache likely
holds them: a shared system prompt then prefills once per engine, not per request); an
engine that dies fails its own requests (its
AsyncLLMEngine ends their streams with an error) and takes no new ones, while the others
keep serving. On a host with at least N GPUs (and no GPU named in `device`) engine i runs
on cuda:i (under tensor parallelism of M ranks, on cuda:i*M to cuda:i*M+M-1); otherwise
the engines share the device's memory, each with its share of gpu_memory_utilization.
Engine i takes the config's seed + i. The server reads this object like an AsyncLLMEngine;
with several API server processes, each holds one, attached to every engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections import OrderedDict

from ..config import EngineConfig
from .async_llm_engine import AsyncLLMEngine, EngineDeadError, RequestStream

PREFIX_TOKENS = 64   # what identifies a prompt's prefix for routing
OVERLOAD = 4         # how much busier than the least busy the prefix's engine may be
_PREFIXES_KEPT = 10_000

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


def replica_configs(config: EngineConfig, size: int) -> list[EngineConfig]:
    """Each engine's config: GPUs of its own where the host has enough (one per tensor-
    parallel rank on this node: engine i from cuda:i*ranks) and the config names none
    ("auto", "cuda"), else the shared device(s) and 1/size of their memory."""
    import torch

    from ..config import resolve_device
    device = resolve_device(config.device)
    ranks = max(config.tensor_parallel_size // max(config.nnodes, 1), 1)
    # Each engine its own seed: unseeded requests draw from (engine seed, request number),
    # and the engines number their requests alike.
    seeds = [dataclasses.replace(config, seed=(config.seed + i) % 2**63, data_parallel_rank=i)
             for i in range(size)]
    if (device.type == "cuda" and device.index is None
            and torch.cuda.device_count() >= size * ranks):
        return [dataclasses.replace(c, device=f"cuda:{i * ranks}") for i, c in enumerate(seeds)]
    share = config.gpu_memory_utilization / size
    return [dataclasses.replace(c, gpu_memory_utilization=share) for c in seeds]


class DataParallelEngine:
    """extra_frontends=K: every engine serves K more frontends (`minivllm serve
    --api-servers K+1`); `frontend_connections` holds, per extra frontend, its
    connections to the N engines, for DataParallelEngine.attach() in another process.
    Each frontend routes its own requests by its own counts."""

    def __init__(self, config: EngineConfig | None, size: int, *,
                 max_waiting_requests: int | None = None, start: bool = True,
                 extra_frontends: int = 0, _attach_to: list | None = None) -> None:
        if size < 1:
            raise ValueError(f"data_parallel_size must be at least 1, got {size}.")
        if _attach_to is not None:
            self.replicas = [AsyncLLMEngine.attach(c, max_waiting_requests=max_waiting_requests)
                             for c in _attach_to]
        else:
            self.replicas = [AsyncLLMEngine(c, max_waiting_requests=max_waiting_requests,
                                            engine_process=True, start=False,
                                            extra_frontends=extra_frontends)
                             for c in replica_configs(config, size)]
        self._extra_frontends = extra_frontends
        self.stat_loggers = _StatLoggers(self.replicas)
        self.engine = None  # the engines live in other processes
        self._prefix_engine: OrderedDict[tuple, int] = OrderedDict()  # prefix -> engine
        if start:
            self.start()

    @classmethod
    def attach(cls, connections: list, *,
               max_waiting_requests: int | None = None) -> "DataParallelEngine":
        """A frontend of engines started by another DataParallelEngine (one entry of its
        `frontend_connections`: a connection per engine), started."""
        return cls(None, len(connections), max_waiting_requests=max_waiting_requests,
                   _attach_to=connections)

    def launch(self) -> "DataParallelEngine":
        """Start every engine's process without waiting (the models load side by side);
        `frontend_connections` are then ready."""
        for r in self.replicas:
            r.launch()
        return self

    @property
    def frontend_connections(self) -> list[list]:
        return [[r.frontend_connections[k] for r in self.replicas]
                for k in range(self._extra_frontends)]

    def start(self, timeout: float | None = None) -> "DataParallelEngine":
        self.launch()
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

    def pick(self, token_ids: list[int] | None = None) -> AsyncLLMEngine:
        """The engine for a request (see the module docstring)."""
        live = [i for i, r in enumerate(self.replicas) if r.accepting]
        if not live:
            raise EngineDeadError("No engine is running.")
        least = min(live, key=lambda i: self.replicas[i].num_in_flight)
        key = tuple(token_ids[:PREFIX_TOKENS]) if token_ids and len(
            token_ids) >= PREFIX_TOKENS else None
        if key is None:
            return self.replicas[least]
        chosen = self._prefix_engine.get(key)
        if chosen not in live or (self.replicas[chosen].num_in_flight
                                  > self.replicas[least].num_in_flight + OVERLOAD):
            chosen = least
        self._prefix_engine[key] = chosen
        self._prefix_engine.move_to_end(key)
        if len(self._prefix_engine) > _PREFIXES_KEPT:
            self._prefix_engine.popitem(last=False)
        return self.replicas[chosen]

    async def add_requests(self, specs: list[dict]) -> list[RequestStream]:
        ids = None
        if specs:
            prompt = specs[0].get("prompt")
            ids = (prompt.get("prompt_token_ids") if isinstance(prompt, dict)
                   else specs[0].get("prompt_token_ids"))
        return await self.pick(ids).add_requests(specs)

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


# ---- offline: LLM(data_parallel_size=N) ---------------------------------------------------

def _replica_main(config: EngineConfig, conn) -> None:
    """A replica: its own LLM, answering generate() calls sent over `conn` until None."""
    from ..llm import LLM
    llm = LLM(**{f.name: getattr(config, f.name) for f in dataclasses.fields(config)})
    conn.send("ready")
    while True:
        job = conn.recv()
        if job is None:
            return
        if job == "reset_prefix_cache":
            conn.send(llm.reset_prefix_cache())
            continue
        try:
            prompts, params, default_max_tokens = job
            conn.send(llm._generate_here(prompts, params, False, default_max_tokens))
        except Exception as e:  # noqa: BLE001 - the caller raises it
            conn.send(e)


class OfflineReplicas:
    """The other engines of LLM(data_parallel_size=N): N - 1 processes, one per config
    (replica_configs' 2nd to Nth); each generate() gives every engine (the caller's own
    included) a contiguous share of the prompts."""

    def __init__(self, configs: list[EngineConfig]) -> None:
        import multiprocessing
        import multiprocessing.util
        ctx = multiprocessing.get_context("spawn")
        self.conns, self.procs = [], []
        for i, config in enumerate(configs):
            mine, theirs = ctx.Pipe()
            replica = dataclasses.replace(config, data_parallel_size=1)
            # A daemon may not have children: a replica with tensor-parallel workers is
            # none (the finalizer below stops it at exit, before multiprocessing joins it).
            p = ctx.Process(target=_replica_main, args=(replica, theirs),
                            daemon=config.tensor_parallel_size == 1, name=f"minivllm-dp{i + 1}")
            p.start()
            theirs.close()  # so that a replica's death reads as the end of its pipe
            self.conns.append(mine)
            self.procs.append(p)
        for i, conn in enumerate(self.conns):
            try:
                ready = conn.recv()
            except EOFError:
                ready = None
            if ready != "ready":
                _stop_replicas(self.conns, self.procs)
                raise RuntimeError(f"Data-parallel replica {i + 1} exited while starting "
                                   f"(exit code {self.procs[i].exitcode}); its log says why.")
        # Also at exit, before multiprocessing joins the replicas that are no daemons.
        multiprocessing.util.Finalize(self, _stop_replicas, (self.conns, self.procs),
                                      exitpriority=0)

    def generate(self, local_generate, prompts: list, params: list,
                 default_max_tokens: bool = False) -> list:
        """The outputs of every prompt, in order: the replicas' shares sent first, the
        caller's own run by `local_generate` meanwhile (see LLMEngine.add_request for
        default_max_tokens)."""
        n = len(self.conns) + 1
        bounds = [len(prompts) * i // n for i in range(n + 1)]
        for i, conn in enumerate(self.conns, start=1):
            conn.send((prompts[bounds[i]:bounds[i + 1]], params[bounds[i]:bounds[i + 1]],
                       default_max_tokens))
        outputs = local_generate(prompts[:bounds[1]], params[:bounds[1]])
        for conn in self.conns:
            part = conn.recv()
            if isinstance(part, BaseException):
                raise part
            outputs += part
        return outputs


    def reset_prefix_cache(self) -> bool:
        """Every replica's LLM.reset_prefix_cache()."""
        for conn in self.conns:
            conn.send("reset_prefix_cache")
        return all([conn.recv() for conn in self.conns])


def _stop_replicas(conns: list, procs: list) -> None:
    for conn in conns:
        try:
            conn.send(None)
        except (OSError, ValueError):
            pass
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
