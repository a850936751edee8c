"""The engine side of AsyncLLMEngine: one LLMEngine driven by commands, reporting events.

EngineCore knows nothing of asyncio or streams. Each iteration of its owner's loop applies
the commands that arrived (add, abort, call), runs one step if there is work, and reports
what happened as a list of plain events keyed by request id:

    ("added", rid, error | None)            the add was accepted (None) or refused
    ("output", RequestOutput)               a live request's new cumulative output (with
                                            report_requests: its Request itself, to be
                                            encoded before the next step)
    ("aborted", rid, final | None, live)    final: its last output with finish_reason
                                            "abort"; live: the engine still had it
    ("failed", rid, error)                  a step failed while the request was in it
    ("called", call_id, error | None, value)

Two owners run it (see AsyncLLMEngine):
- a thread of the server's process (tests; anything that needs `submit(lambda e: ...)`),
- a process of its own (engine_process.py, the server's default): the engine's Python
  work no longer shares a GIL with the HTTP event loop. With a shared GIL, every torch call
  of a step releases and re-takes the GIL, and each re-take can wait a whole switch
  interval behind the event loop: on the H200 the threaded server reached 31% of the
  offline engine's throughput at 64 concurrent streams. Outputs cross that boundary as
  deltas (output_codec.py).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from ..outputs import CompletionOutput, RequestOutput
from .llm_engine import LLMEngine

logger = logging.getLogger(__name__)


class EngineStepError(RuntimeError):
    """A step of the engine failed while this request was in it."""


class EngineCore:
    def __init__(self, engine: LLMEngine, report_requests: bool = False) -> None:
        """report_requests: "output" events carry the Request, not a RequestOutput (the
        engine process encodes only what changed straight from it: no cumulative output
        is built per request per step)."""
        self.engine = engine
        self.report_requests = report_requests
        # Live requests added through this core -> their last output (None before one,
        # and always None with report_requests: an abort builds the final one then).
        self.last: dict[str, RequestOutput | None] = {}

    def has_work(self) -> bool:
        return self.engine.has_unfinished_requests()

    # ---- commands -----------------------------------------------------------------------

    def apply(self, command: tuple, events: list) -> None:
        kind = command[0]
        if kind == "add":
            _, rid, prompt, params, prompt_token_ids, arrival_time = command
            try:
                if rid in self.last:
                    raise ValueError(f"Request id {rid!r} is already in use.")
                self.engine.add_request(prompt, params, request_id=rid,
                                        prompt_token_ids=prompt_token_ids,
                                        arrival_time=arrival_time)
            except Exception as e:  # noqa: BLE001 - handed to the caller
                events.append(("added", rid, e))
                return
            self.last[rid] = None
            events.append(("added", rid, None))
        elif kind == "abort":
            for rid in command[1]:
                self.abort(rid, events)
        elif kind == "call":
            _, call_id, fn = command
            try:
                events.append(("called", call_id, None, fn(self.engine)))
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                events.append(("called", call_id, e, None))
        else:
            raise ValueError(f"unknown engine command {kind!r}")

    def abort(self, rid: str, events: list) -> None:
        eng = self.engine
        known = rid in self.last
        last = self.last.pop(rid, None)
        req = eng.requests.get(rid)
        final = None
        if known and (req is not None or last is not None):
            final = abort_output(last, eng, req)
        eng.abort_request(rid)
        if known or req is not None:
            events.append(("aborted", rid, final, req is not None))

    def abort_all(self, events: list) -> None:
        for rid in list(self.last):
            self.abort(rid, events)
        for rid in list(self.engine.requests):
            self.engine.abort_request(rid)

    # ---- stepping -----------------------------------------------------------------------

    def step(self, events: list) -> list:
        """One engine step; returns all its outputs (for stat loggers; Requests with
        report_requests), and reports those of live requests as events."""
        eng = self.engine
        try:
            outputs = eng.step_requests() if self.report_requests else eng.step()
        except Exception as e:  # noqa: BLE001 - fail the affected requests, keep serving
            if eng.runner.tp is not None:
                raise  # the ranks may be out of step (LLMEngine._step): the engine is dead
            logger.exception("Engine step failed")
            self._fail_step(e, events)
            return []
        if not outputs and eng.requests and not eng.has_work():
            # Requests the scheduler no longer knows: fail them rather than spin.
            self._fail_step(RuntimeError("request lost by the scheduler"), events)
            return []
        for out in outputs:
            rid = out.request_id
            if rid not in self.last:
                continue
            if out.finished:
                del self.last[rid]
            elif not self.report_requests:
                self.last[rid] = out
            events.append(("output", out))
        return outputs

    def _fail_step(self, error: Exception, events: list) -> None:
        """Fail the requests the failed step was working on (those running); if none can be
        told apart, everything in flight. Their blocks are freed; others carry on."""
        eng = self.engine
        affected = {s.request.request_id for s in eng.scheduler.running}
        if not affected:
            affected = set(eng.requests)
        for rid in affected:
            try:
                eng.abort_request(rid)
            except Exception:  # noqa: BLE001
                logger.exception("abort after a failed step failed")
            self.last.pop(rid, None)
            err = EngineStepError(f"The engine failed while running this request: {error!r}")
            err.__cause__ = error
            events.append(("failed", rid, err))

    def snapshot(self) -> dict[str, Any]:
        eng = self.engine
        sched = eng.scheduler
        return {
            "time": time.monotonic(),
            "num_requests_running": len({s.request.request_id for s in sched.running}),
            "num_requests_waiting": len({s.request.request_id for s in sched.waiting}),
            "num_unfinished": len(eng.requests),
            "kv_cache_usage": sched.pool.usage,
            "num_free_blocks": sched.pool.num_free,
            "num_blocks": sched.pool.num_blocks,
            "num_preemptions": sched.num_preemptions,
            "prefix_cache_queries": sched.pool.cache_queries * sched.block_size,
            "prefix_cache_hits": sched.pool.cache_hits * sched.block_size,
            "prompt_tokens": eng.stats.get("prompt_tokens", 0),
            "generation_tokens": eng.stats.get("generation_tokens", 0),
            **{k: v for k, v in eng.stats.items() if k.startswith("spec_decode_")},
        }


def engine_idle(engine: LLMEngine) -> bool:
    """No request left and every KV block free (for AsyncLLMEngine.submit; module-level so
    it also crosses to an engine process)."""
    return engine.scheduler.pool.all_free() and not engine.requests


def abort_output(last: RequestOutput | None, eng: LLMEngine, req) -> RequestOutput:
    """The final output of a request aborted while someone may still be reading: what it
    had shown so far, with finish_reason "abort" on the samples that were still running."""
    if last is None:
        last = eng.make_output(req)
    outputs = [CompletionOutput(
        index=o.index, text=o.text, token_ids=list(o.token_ids),
        cumulative_logprob=o.cumulative_logprob,
        logprobs=list(o.logprobs) if o.logprobs is not None else None,
        finish_reason=o.finish_reason or "abort", stop_reason=o.stop_reason)
        for o in last.outputs]
    return RequestOutput(last.request_id, last.prompt, last.prompt_token_ids, outputs, True,
                         last.prompt_logprobs, last.metrics, last.num_cached_tokens,
                         dict(last.extra))
