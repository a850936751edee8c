"""The engine side of AsyncLLMEngine: one LLMEngine driven by commands, reporting events.

EngineCore knows nothing of asyncio or streams. Each iteration of its owner's loop applies
the commands that arrived (add, abort, call), runs one step if there is work, and reports
what happened as a list of plain events keyed by request id:

    ("added", rid, error | None)            the add was accepted (None) or refused
    ("output", RequestOutput)               a live request's new cumulative output
    ("aborted", rid, final | None, live)    final: its last output with finish_reason
                                            "abort"; live: the engine still had it
    ("failed", rid, error)                  a step failed while the request was in it
    ("called", call_id, error | None, value)

Two owners run it (see AsyncLLMEngine):
- a thread of the server's process (tests; anything that needs `submit(lambda e: ...)`),
- a process of its own (`run_engine_process`, the server's default): the engine's Python
  work no longer shares a GIL with the HTTP event loop. With a shared GIL, every torch call
  of a step releases and re-takes the GIL, and each re-take can wait a whole switch
  interval behind the event loop: on the H200 the threaded server reached 31% of the
  offline engine's throughput at 64 concurrent streams.

Across the process boundary outputs travel as deltas (OutputEncoder / OutputDecoder):
outputs are cumulative, and pickling every request's whole token list each step would
cost O(length) per token.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from ..outputs import CompletionOutput, RequestMetrics, RequestOutput
from .llm_engine import LLMEngine

logger = logging.getLogger(__name__)


class EngineStepError(RuntimeError):
    """A step of the engine failed while this request was in it."""


class EngineCore:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        # Live requests added through this core -> their last output (None before one).
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

    def step(self, events: list) -> list[RequestOutput]:
        """One engine step; returns all its outputs (for stat loggers), and reports those
        of live requests as events."""
        eng = self.engine
        try:
            outputs = eng.step()
        except Exception as e:  # noqa: BLE001 - fail the affected requests, keep serving
            logger.exception("Engine step failed")
            self._fail_step(e, events)
            return []
        if not outputs and eng.requests and not eng.scheduler.has_work():
            # Requests the scheduler no longer knows: fail them rather than spin.
            self._fail_step(RuntimeError("request lost by the scheduler"), events)
            return []
        for out in outputs:
            rid = out.request_id
            if rid not in self.last:
                continue
            if out.finished:
                del self.last[rid]
            else:
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


# ---- outputs across a process boundary ------------------------------------------------

class OutputEncoder:
    """Engine side: turns cumulative RequestOutputs into what changed since the last one
    sent for the same request (text, token ids and logprobs only ever grow)."""

    def __init__(self) -> None:
        self._sent: dict[str, dict] = {}  # rid -> {"samples": {index: (t, n, l)}, "plp": n}

    def encode(self, out: RequestOutput) -> tuple:
        rid = out.request_id
        state = self._sent.get(rid)
        first = state is None
        if first:
            state = self._sent[rid] = {"samples": {}, "plp": 0}
        samples = []
        for o in out.outputs:
            t, n, lp = state["samples"].get(o.index, (0, 0, 0))
            if len(o.text) < t or len(o.token_ids) < n:  # not a growth: resend it whole
                t = n = lp = 0
                reset = True
            else:
                reset = False
            logprobs = o.logprobs[lp:] if o.logprobs is not None else None
            samples.append((o.index, reset, o.text[t:], o.token_ids[n:], logprobs,
                            o.cumulative_logprob, o.finish_reason, o.stop_reason))
            state["samples"][o.index] = (len(o.text), len(o.token_ids),
                                         len(o.logprobs) if o.logprobs is not None else 0)
        plp = out.prompt_logprobs
        new_plp = None
        if plp is not None and len(plp) != state["plp"]:
            new_plp = plp[state["plp"]:]
            state["plp"] = len(plp)
        prompt = (out.prompt, out.prompt_token_ids) if first else None
        if out.finished:
            del self._sent[rid]
        m = out.metrics
        # Plain tuples and builtins only: pickling a dataclass goes through Python-level
        # __reduce_ex__ and cost ~17 us per output (4 ms per step at batch 256).
        metrics = None if m is None else (m.arrival_time, m.first_scheduled_time,
                                           m.first_token_time, m.finished_time)
        return (rid, prompt, plp is not None, new_plp, metrics, out.num_cached_tokens,
                out.extra or None, out.finished, samples)

    def forget(self, rid: str) -> None:
        self._sent.pop(rid, None)


class OutputDecoder:
    """Frontend side: rebuilds the cumulative RequestOutputs from OutputEncoder's deltas."""

    def __init__(self) -> None:
        self._state: dict[str, dict] = {}

    def decode(self, msg: tuple) -> RequestOutput:
        (rid, prompt, has_plp, new_plp, metrics, num_cached, extra, finished, samples) = msg
        metrics = RequestMetrics(*metrics) if metrics is not None else None
        state = self._state.get(rid)
        if state is None:
            state = self._state[rid] = {"prompt": None, "prompt_token_ids": [],
                                        "plp": [] if has_plp else None, "samples": {}}
        if prompt is not None:
            state["prompt"], state["prompt_token_ids"] = prompt
        if new_plp:
            if state["plp"] is None:
                state["plp"] = []
            state["plp"].extend(new_plp)
        outputs = []
        for index, reset, text, token_ids, logprobs, cum_lp, finish, stop in samples:
            s = state["samples"].get(index)
            if s is None or reset:
                s = state["samples"][index] = {"text": "", "ids": [], "lps": None}
            s["text"] += text
            s["ids"].extend(token_ids)
            if logprobs is not None:
                if s["lps"] is None:
                    s["lps"] = []
                s["lps"].extend(logprobs)
            outputs.append(CompletionOutput(
                index=index, text=s["text"], token_ids=list(s["ids"]),
                cumulative_logprob=cum_lp,
                logprobs=list(s["lps"]) if s["lps"] is not None else None,
                finish_reason=finish, stop_reason=stop))
        if finished:
            del self._state[rid]
        plp = list(state["plp"]) if state["plp"] is not None else None
        return RequestOutput(rid, state["prompt"], state["prompt_token_ids"], outputs,
                             finished, plp, metrics, num_cached, extra or {})

    def forget(self, rid: str) -> None:
        self._state.pop(rid, None)


def _map_outputs(events: list, convert, forget) -> list:
    """The events with every output converted (encoded or decoded); the codec forgets a
    request once it was aborted or failed (a finished one it drops itself)."""
    mapped = []
    for ev in events:
        kind = ev[0]
        if kind == "output":
            mapped.append(("output", convert(ev[1])))
        elif kind == "aborted":
            rid, final, live = ev[1], ev[2], ev[3]
            mapped.append(("aborted", rid, convert(final) if final is not None else None, live))
            forget(rid)
        else:
            if kind == "failed":
                forget(ev[1])
            mapped.append(ev)
    return mapped


def encode_events(events: list, encoder: OutputEncoder) -> list:
    return _map_outputs(events, encoder.encode, encoder.forget)


def decode_events(wire: list, decoder: OutputDecoder) -> list:
    return _map_outputs(wire, decoder.decode, decoder.forget)


# ---- the engine process ---------------------------------------------------------------

def _picklable_error(e: BaseException) -> BaseException:
    import pickle
    try:
        pickle.dumps(e)
        return e
    except Exception:  # noqa: BLE001
        return RuntimeError(f"{type(e).__name__}: {e}")


def engine_facts(engine: LLMEngine) -> dict:
    """What the frontend needs to know about the model, sent once at start-up."""
    return {"tokenizer": engine.tokenizer, "model_path": engine.model_path,
            "max_model_len": engine.max_model_len, "vocab_size": engine.vocab_size,
            "eos_token_ids": frozenset(engine.eos_token_ids)}


def run_engine_process(config, conn, log_level: int = logging.INFO) -> None:
    """Main of the engine process (multiprocessing 'spawn'). Talks over `conn` (a Pipe end):
    receives commands, sends ("ready", facts) | ("init_error", error) once, then one
    ("events", wire_events, snapshot, stepped) per loop iteration that did something, and
    ("stopped",) at the end. Every request here came through the core, so a step's outputs
    are exactly its "output" events."""
    import signal

    # Ctrl-C reaches the whole process group: the frontend handles it and sends "stop".
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level,
                        format="%(levelname)s %(asctime)s %(name)s [engine]: %(message)s")
    try:
        core = EngineCore(LLMEngine(config))
        conn.send(("ready", {**engine_facts(core.engine), "snapshot": core.snapshot()}))
    except BaseException as e:  # noqa: BLE001 - reported to the frontend
        if not isinstance(e, (ValueError, OSError)):  # a bad flag or path needs no traceback
            logger.exception("The engine failed to start")
        conn.send(("init_error", _picklable_error(e)))
        return
    encoder = OutputEncoder()
    try:
        while True:
            if not core.has_work():
                conn.poll(None)  # idle: sleep until a command arrives
            commands = []
            while conn.poll(0):
                commands.append(conn.recv())
            events: list = []
            stop = False
            for command in commands:
                if command[0] == "stop":
                    stop = True
                    continue
                if command[0] == "call":
                    command = (*command[:2], _unpickle_call(command[2]))
                core.apply(command, events)
            if stop:
                core.abort_all(events)
                conn.send(("events", _wire(events, encoder), core.snapshot(), False))
                conn.send(("stopped",))
                return
            outputs = core.step(events) if core.has_work() else None
            if events or commands or outputs is not None:
                conn.send(("events", _wire(events, encoder), core.snapshot(),
                           outputs is not None))
    except (EOFError, BrokenPipeError, ConnectionResetError):
        return  # the frontend went away
    except BaseException as e:  # noqa: BLE001 - must not vanish silently
        logger.exception("The engine process died")
        try:
            conn.send(("dead", _picklable_error(e)))
        except Exception:  # noqa: BLE001
            pass


def engine_process_main(config, conn, log_level: int = logging.INFO) -> None:
    """The engine process's target: run_engine_process, then leave without the
    interpreter's teardown (Triton's bindings print a wall of "leaked type" warnings from
    it; nothing is left to clean up once the frontend has been told "stopped")."""
    import os
    import sys

    code = 0
    try:
        run_engine_process(config, conn, log_level)
    except BaseException:  # noqa: BLE001
        code = 1
    finally:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _unpickle_call(payload):
    import pickle
    try:
        return pickle.loads(payload)
    except Exception as e:  # noqa: BLE001
        def fail(_engine, e=e):
            raise RuntimeError(f"could not unpickle the function: {e!r}")
        return fail


def _wire(events: list, encoder: OutputEncoder) -> list:
    # Errors raised by user functions or add_request may not pickle: make sure they do.
    out = []
    for ev in encode_events(events, encoder):
        if ev[0] == "added" and ev[2] is not None:
            ev = ("added", ev[1], _picklable_error(ev[2]))
        elif ev[0] == "called":
            ev = ("called", ev[1], _picklable_error(ev[2]) if ev[2] is not None else None,
                  ev[3])
        elif ev[0] == "failed":
            ev = ("failed", ev[1], _picklable_error(ev[2]))
        out.append(ev)
    return out
