"""AsyncLLMEngine: the synchronous LLMEngine behind an asyncio interface.

One dedicated background thread owns the LLMEngine: it builds it, steps it whenever
there is work, and sleeps on a condition variable when there is none. Nothing else ever
touches the engine. Coroutines talk to that thread through two one-way channels:

    asyncio handler --(command list + condition)--> engine thread
        add / abort / call(fn) / stop
    engine thread --(loop.call_soon_threadsafe, once per step)--> per-request asyncio queues
        RequestOutput | exception

so requests that arrive while a step runs all land in the next step's batch.

Guarantees:
- add_request() validates on the engine thread and raises ValueError to the caller before
  any output exists (a server answers 400 before streaming starts).
- abort(request_id) may be called from any thread; the engine thread frees the request's
  KV blocks before its next step. A consumer that stops reading (client disconnect,
  cancelled task) aborts its request.
- An exception inside a step fails the requests that step touched (their iterators
  raise EngineStepError, chained to the cause); the engine keeps serving the others.
- max_waiting_requests bounds the requests accepted but not yet producing output;
  past it add_request raises QueueFullError (a server answers 503).
- shutdown() stops admission, lets in-flight requests finish for a while, aborts the
  rest (their streams end with finish_reason "abort") and joins the thread.

This module imports no server code (fastapi, uvicorn, ...): the engine stays usable where
only the engine is installed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import logging
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from ..config import EngineConfig
from ..outputs import CompletionOutput, RequestOutput
from ..sampling_params import SamplingParams
from .llm_engine import LLMEngine

logger = logging.getLogger(__name__)


SWITCH_INTERVAL_S = 0.0005


class EngineDeadError(RuntimeError):
    """The engine thread is not running (never started, stopped, or crashed)."""


class EngineStepError(RuntimeError):
    """A step of the engine failed while this request was in it."""


class RequestAbortedError(RuntimeError):
    """The request was aborted before it produced anything."""


class QueueFullError(RuntimeError):
    """Too many requests are waiting; try again later."""


class EngineShuttingDownError(RuntimeError):
    """The engine is shutting down and accepts no new requests."""


class StatLogger(Protocol):
    """Hooks the engine thread calls (a server's metrics implement them)."""

    def on_step(self, now: float, outputs: list[RequestOutput]) -> None: ...

    def on_abort(self, request_id: str) -> None:
        """A live request was aborted (or failed) before it finished."""


class RequestStream:
    """The consumer side of one request: an asyncio queue the engine thread feeds."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False  # the last item was taken (a finished output or an error)
        self._holds_reservation = False  # counts in the engine's waiting/in-flight numbers
        self.started = False   # the first output was delivered
        self.last_output: RequestOutput | None = None  # engine-thread side, for aborts

    def _take(self, item: RequestOutput | BaseException) -> RequestOutput:
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    async def get(self) -> RequestOutput:
        """The next output (raises the request's error, if it failed)."""
        if self.finished:
            raise StopAsyncIteration
        return self._take(await self.queue.get())

    async def get_latest(self) -> RequestOutput:
        """Wait for an output, then skip to the newest one already queued. Outputs are
        cumulative (full text, all tokens and logprobs so far), so nothing is lost."""
        out = await self.get()
        while not self.finished and not self.queue.empty():
            out = self._take(self.queue.get_nowait())
        return out

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        return await self.get()


class AsyncLLMEngine:
    """Owns an LLMEngine on a background thread. Build with an EngineConfig (the engine is
    built on that thread) or an existing LLMEngine (handed over: stop using it)."""

    def __init__(self, engine: EngineConfig | LLMEngine, *,
                 max_waiting_requests: int | None = None,
                 stat_loggers: list[StatLogger] | None = None,
                 start: bool = True) -> None:
        if max_waiting_requests is not None and max_waiting_requests < 1:
            raise ValueError("max_waiting_requests must be at least 1 (or None: no limit).")
        self._config_or_engine = engine
        self.engine: LLMEngine | None = engine if isinstance(engine, LLMEngine) else None
        self.max_waiting_requests = max_waiting_requests
        self.stat_loggers: list[StatLogger] = list(stat_loggers or [])
        self._cv = threading.Condition()
        self._commands: list[tuple] = []
        self._stop = False
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._init_error: BaseException | None = None
        self.dead_error: BaseException | None = None
        self._accepting = True
        # Frontend state (event loops), under _count_lock.
        self._count_lock = threading.Lock()
        self._num_not_started = 0
        self._num_in_flight = 0
        # Engine-thread state.
        self._streams: dict[str, RequestStream] = {}
        # Published by the engine thread after each iteration; read by anyone.
        self.snapshot: dict[str, Any] = {}
        # Facts about the model, set once the engine exists (read-only afterwards).
        self.tokenizer = None
        self.model_path = None
        self.max_model_len: int = 0
        self.vocab_size: int = 0
        self.eos_token_ids: frozenset[int] = frozenset()
        if start:
            self.start()

    # ---- lifecycle ----------------------------------------------------------------------

    def start(self, timeout: float | None = None) -> "AsyncLLMEngine":
        """Start the engine thread (building the engine there) and wait until it is ready;
        an error while building the engine is raised here."""
        if self._thread is None:
            # The engine thread and the event loop share the GIL; at the default 5 ms switch
            # interval a decode step (a few ms on a GPU) can wait a whole interval for it.
            sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))
            self._thread = threading.Thread(target=self._thread_main, name="minivllm-engine",
                                            daemon=True)
            self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError("The engine did not start in time.")
        if self._init_error is not None:
            raise self._init_error
        return self

    @property
    def is_running(self) -> bool:
        return (self._thread is not None and self._thread.is_alive() and self._ready.is_set()
                and self._init_error is None and self.dead_error is None)

    @property
    def accepting(self) -> bool:
        return self._accepting and self.is_running

    @property
    def num_in_flight(self) -> int:
        """Requests added through this object and not yet finished (event-loop count)."""
        return self._num_in_flight

    async def shutdown(self, drain_timeout: float = 0.0) -> None:
        """Stop admitting requests, let in-flight ones finish for up to drain_timeout
        seconds, abort the rest and stop the thread."""
        self._accepting = False
        deadline = time.monotonic() + max(0.0, drain_timeout)
        while self.is_running and time.monotonic() < deadline and (
                self.snapshot.get("num_unfinished", 0) or self._num_in_flight):
            await asyncio.sleep(0.02)
        await asyncio.get_running_loop().run_in_executor(None, self.stop)

    def stop(self, timeout: float | None = 30.0) -> None:
        """Abort whatever is in flight and stop the thread (blocking; any thread)."""
        self._accepting = False
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    # ---- commands (any thread) ----------------------------------------------------------

    def _send(self, command: tuple) -> None:
        with self._cv:
            if self._stop:
                raise EngineDeadError("The engine has stopped.")
            self._commands.append(command)
            self._cv.notify()

    def _check_alive(self) -> None:
        if self._init_error is not None:
            raise EngineDeadError(f"The engine failed to start: {self._init_error}")
        if self.dead_error is not None:
            raise EngineDeadError(f"The engine thread died: {self.dead_error}")
        if not self.is_running:
            raise EngineDeadError("The engine is not running.")

    def submit(self, fn: Callable[[LLMEngine], Any]) -> concurrent.futures.Future:
        """Run fn(engine) on the engine thread between steps; a Future of its result."""
        self._check_alive()
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._send(("call", fn, fut))
        return fut

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Await fn(engine), run on the engine thread between steps."""
        return await asyncio.wrap_future(self.submit(fn))

    def abort(self, request_id: str | list[str]) -> None:
        """Abort request(s) (any thread). Their blocks are freed before the next step;
        a consumer still reading gets a final output with finish_reason "abort"."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        if not ids:
            return
        try:
            self._send(("abort", ids))
        except EngineDeadError:
            pass

    async def add_request(self, request_id: str, prompt: str | list[int] | dict | None,
                          params: SamplingParams, *, prompt_token_ids: list[int] | None = None,
                          arrival_time: float | None = None) -> RequestStream:
        """Queue a request; returns its stream once the engine accepted it. Raises
        ValueError (invalid request), QueueFullError, EngineShuttingDownError or
        EngineDeadError before anything is generated."""
        [stream] = await self.add_requests([dict(
            request_id=request_id, prompt=prompt, params=params,
            prompt_token_ids=prompt_token_ids, arrival_time=arrival_time)])
        return stream

    async def add_requests(self, specs: list[dict]) -> list[RequestStream]:
        """Queue several requests all or nothing (a server's batched prompts): each spec
        holds request_id, prompt, params and optionally prompt_token_ids, arrival_time.
        If one is refused, the others are aborted and the error is raised."""
        if not specs:
            return []
        self._reserve(len(specs))
        loop = asyncio.get_running_loop()
        now = time.monotonic()
        pending: list[tuple[RequestStream, asyncio.Future]] = []
        send_error = None
        for spec in specs:
            stream = RequestStream(spec["request_id"], loop)
            stream._holds_reservation = True
            accepted = loop.create_future()
            accepted.add_done_callback(
                lambda f, stream=stream: self._on_add_settled(f, stream))
            try:
                self._send(("add", stream, spec.get("prompt"), spec["params"],
                            spec.get("prompt_token_ids"), spec.get("arrival_time") or now,
                            accepted))
            except BaseException as e:  # noqa: BLE001
                send_error = e
                accepted.cancel()  # releases this one's reservation
                break
            pending.append((stream, accepted))
        self._release(len(specs) - len(pending) - (send_error is not None))
        try:
            results = await asyncio.gather(*(a for _, a in pending), return_exceptions=True)
        except asyncio.CancelledError:
            # The caller went away while the engine was accepting: don't leave them running.
            self.abort([s.request_id for s, _ in pending])
            raise
        error = send_error
        for res in results:
            if isinstance(res, BaseException):
                error = error or res
        if error is not None:
            self.abort([s.request_id for s, a in pending if not a.cancelled()
                        and a.exception() is None])
            raise error
        return [s for s, _ in pending]

    def _on_add_settled(self, fut: asyncio.Future, stream: RequestStream) -> None:
        # A refused (or abandoned) add never gets outputs: give its reservation back here.
        # An accepted one gives it back through _deliver.
        if fut.cancelled() or fut.exception() is not None:
            if stream._holds_reservation:
                stream._holds_reservation = False
                self._release(1)

    def _reserve(self, count: int) -> None:
        if not self._accepting:
            raise EngineShuttingDownError("The server is shutting down.")
        self._check_alive()
        limit = self.max_waiting_requests
        with self._count_lock:
            if limit is not None and self._num_not_started + count > limit:
                raise QueueFullError(
                    f"Too many waiting requests ({self._num_not_started} waiting, limit "
                    f"{limit}); try again later.")
            self._num_not_started += count
            self._num_in_flight += count

    def _release(self, count: int) -> None:
        with self._count_lock:
            self._num_not_started -= count
            self._num_in_flight -= count

    async def generate(self, prompt: str | list[int] | dict | None, params: SamplingParams,
                       request_id: str, *, prompt_token_ids: list[int] | None = None,
                       arrival_time: float | None = None) -> AsyncIterator[RequestOutput]:
        """Yield cumulative RequestOutputs for one request until it finishes. Validation
        errors raise ValueError at the first iteration; stopping early aborts it."""
        stream = await self.add_request(request_id, prompt, params,
                                        prompt_token_ids=prompt_token_ids,
                                        arrival_time=arrival_time)
        try:
            async for out in stream:
                yield out
        finally:
            if not stream.finished:
                self.abort(request_id)

    # ---- delivery (event loop thread) ---------------------------------------------------

    def _deliver(self, items: list[tuple[RequestStream, Any]]) -> None:
        for stream, item in items:
            holds = stream._holds_reservation
            final = isinstance(item, BaseException) or item.finished
            if holds and (final or not stream.started):
                with self._count_lock:
                    if not stream.started:
                        self._num_not_started -= 1
                    if final:
                        self._num_in_flight -= 1
                if final:
                    stream._holds_reservation = False
            stream.started = True
            stream.queue.put_nowait(item)

    # ---- the engine thread --------------------------------------------------------------

    def _thread_main(self) -> None:
        try:
            if self.engine is None:
                self.engine = LLMEngine(self._config_or_engine)  # type: ignore[arg-type]
            eng = self.engine
            self.tokenizer = copy.deepcopy(eng.tokenizer) if eng.tokenizer is not None else None
            self.model_path = eng.model_path
            self.max_model_len = eng.max_model_len
            self.vocab_size = eng.vocab_size
            self.eos_token_ids = frozenset(eng.eos_token_ids)
            self._publish()
        except BaseException as e:  # noqa: BLE001 - reported to start()
            self._init_error = e
            self._ready.set()
            return
        self._ready.set()
        try:
            self._loop()
        except BaseException as e:  # noqa: BLE001 - must not vanish silently
            logger.exception("The engine thread died")
            self.dead_error = e
            self._fail_all(EngineDeadError(f"The engine thread died: {e!r}"))

    def _loop(self) -> None:
        eng = self.engine
        assert eng is not None
        while True:
            with self._cv:
                while not self._commands and not self._stop and not eng.has_unfinished_requests():
                    self._cv.wait()
                commands, self._commands = self._commands, []
                stop = self._stop
            deliveries: list[tuple[RequestStream, Any]] = []
            calls = []
            for command in commands:
                if command[0] == "call":
                    calls.append(command)
                else:
                    self._handle(command, deliveries)
            if commands:
                self._publish()
            for command in calls:  # after publishing: a caller sees a current snapshot
                self._handle(command, deliveries)
            if stop:
                self._abort_all(deliveries)
                self._publish()
                self._flush(deliveries)
                with self._cv:  # late commands: their futures must not hang
                    late, self._commands = self._commands, []
                for command in late:
                    self._reject(command, EngineDeadError("The engine has stopped."))
                return
            if eng.has_unfinished_requests():
                self._step(deliveries)
                # Publish before delivering, so a client that got its last token reads
                # metrics that already count it.
                self._publish()
            self._flush(deliveries)

    def _handle(self, command: tuple, deliveries: list) -> None:
        eng = self.engine
        kind = command[0]
        if kind == "add":
            _, stream, prompt, params, prompt_token_ids, arrival_time, accepted = command
            rid = stream.request_id
            try:
                if rid in self._streams:
                    raise ValueError(f"Request id {rid!r} is already in use.")
                eng.add_request(prompt, params, request_id=rid,
                                prompt_token_ids=prompt_token_ids, arrival_time=arrival_time)
            except Exception as e:  # noqa: BLE001 - handed to the caller
                _resolve(stream.loop, accepted, error=e)
                return
            self._streams[rid] = stream
            _resolve(stream.loop, accepted, result=None)
        elif kind == "abort":
            for rid in command[1]:
                self._abort_one(rid, deliveries)
        elif kind == "call":
            _, fn, fut = command
            if not fut.set_running_or_notify_cancel():
                return
            try:
                fut.set_result(fn(eng))
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                fut.set_exception(e)

    def _reject(self, command: tuple, error: BaseException) -> None:
        if command[0] == "add":
            stream, accepted = command[1], command[-1]
            _resolve(stream.loop, accepted, error=error)
        elif command[0] == "call":
            fut = command[2]
            if fut.set_running_or_notify_cancel():
                fut.set_exception(error)

    def _abort_one(self, rid: str, deliveries: list) -> None:
        eng = self.engine
        stream = self._streams.pop(rid, None)
        req = eng.requests.get(rid)
        final = None
        if stream is not None and (req is not None or stream.last_output is not None):
            final = _abort_output(stream.last_output, eng, req)
        eng.abort_request(rid)
        if req is not None:
            for sl in self.stat_loggers:
                _safe(sl.on_abort, rid)
        if stream is not None:
            deliveries.append((stream, final if final is not None
                               else RequestAbortedError(f"Request {rid} was aborted.")))

    def _abort_all(self, deliveries: list) -> None:
        for rid in list(self._streams):
            self._abort_one(rid, deliveries)
        for rid in list(self.engine.requests):
            self.engine.abort_request(rid)

    def _step(self, deliveries: list) -> None:
        eng = self.engine
        try:
            outputs = eng.step()
        except Exception as e:  # noqa: BLE001 - fail the affected requests, keep serving
            logger.exception("Engine step failed")
            self._fail_step(e, deliveries)
            return
        if not outputs and eng.requests and not eng.scheduler.has_work():
            # Requests the scheduler no longer knows: fail them rather than spin.
            self._fail_step(RuntimeError("request lost by the scheduler"), deliveries)
            return
        now = time.monotonic()
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            stream.last_output = out
            deliveries.append((stream, out))
            if out.finished:
                del self._streams[out.request_id]
        for sl in self.stat_loggers:
            _safe(sl.on_step, now, outputs)

    def _fail_step(self, error: Exception, deliveries: list) -> None:
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
            for sl in self.stat_loggers:
                _safe(sl.on_abort, rid)
            stream = self._streams.pop(rid, None)
            if stream is not None:
                err = EngineStepError(f"The engine failed while running this request: {error!r}")
                err.__cause__ = error
                deliveries.append((stream, err))

    def _fail_all(self, error: BaseException) -> None:
        deliveries = [(s, error) for s in self._streams.values()]
        self._streams.clear()
        self._flush(deliveries)
        with self._cv:
            late, self._commands = self._commands, []
            self._stop = True
        for command in late:
            self._reject(command, error)

    def _flush(self, deliveries: list) -> None:
        """Hand outputs to their event loops: one call_soon_threadsafe per loop per step."""
        if not deliveries:
            return
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for stream, item in deliveries:
            by_loop.setdefault(stream.loop, []).append((stream, item))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(self._deliver, items)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                pass

    def _publish(self) -> None:
        eng = self.engine
        sched = eng.scheduler
        self.snapshot = {
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


def _resolve(loop: asyncio.AbstractEventLoop, fut: asyncio.Future, *, result=None,
             error: BaseException | None = None) -> None:
    def settle() -> None:
        if fut.done():
            return
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)
    try:
        loop.call_soon_threadsafe(settle)
    except RuntimeError:
        pass


def _safe(fn: Callable, *args) -> None:
    try:
        fn(*args)
    except Exception:  # noqa: BLE001 - metrics must never break serving
        logger.exception("stat logger failed")


def _abort_output(last: RequestOutput | None, eng: LLMEngine, req) -> RequestOutput:
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
