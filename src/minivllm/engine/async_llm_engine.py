"""AsyncLLMEngine: the synchronous LLMEngine behind an asyncio interface.

The LLMEngine is driven by an EngineCore (engine_core.py) owned either by a background
thread of this process (the default) or by a process of its own (engine_process=True, what
`minivllm serve` uses). Either way coroutines talk to it through two one-way channels:

    asyncio handler --(commands: add / abort / call / stop)--> engine owner
    engine owner --(one batch of events per iteration, one call_soon_threadsafe per
                    event loop)--> per-request streams (RequestStream)

so requests that arrive while a step runs all land in the next step's batch. With the
thread, the engine's Python work shares the GIL with the event loop; with the process it
does not (see engine_core.py for what that costs), and outputs cross the process boundary
as deltas.

Guarantees:
- add_request() validates on the engine side and raises ValueError to the caller before
  any output exists (a server answers 400 before streaming starts).
- abort(request_id) may be called from any thread; the engine frees the request's KV
  blocks before its next step. A consumer that stops reading (client disconnect,
  cancelled task) aborts its request.
- An exception inside a step fails the requests that step touched (their iterators
  raise EngineStepError, chained to the cause); the engine keeps serving the others.
- max_waiting_requests bounds the requests accepted but not yet producing output;
  past it add_request raises QueueFullError (a server answers 503).
- shutdown() stops admission, lets in-flight requests finish for a while, aborts the
  rest (their streams end with finish_reason "abort") and stops the engine.

This module imports no server code (fastapi, uvicorn, ...): the engine stays usable where
only the engine is installed.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import copy
import itertools
import logging
import multiprocessing
import multiprocessing.util
import pickle
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from ..config import EngineConfig
from ..outputs import RequestOutput
from ..sampling_params import SamplingParams
from ..thread_names import set_os_thread_name
from .engine_core import EngineCore, EngineStepError
from .engine_process import engine_facts, engine_process_main
from .output_codec import DecodedOutput, OutputDecoder, decode_events, materialize
from .llm_engine import LLMEngine

# The GIL switch interval of a process whose threads share the GIL in the serving path
# (Python's default is 5 ms). A thread that releases the GIL for I/O (a socket write, a
# pipe read, a tokenizer's Rust call) waits up to a whole interval to get it back while
# another thread computes: at 5 ms the server made 27,979 tok/s at c=64 on the H200, at
# 0.5 ms 32,911 (bench/results/2026-11-29-h200-w3-gil-switch-interval/).
GIL_SWITCH_INTERVAL_S = 0.0005

logger = logging.getLogger(__name__)

__all__ = ["AsyncLLMEngine", "RequestStream", "EngineDeadError", "EngineStepError",
           "RequestAbortedError", "QueueFullError", "EngineShuttingDownError", "StatLogger"]


class EngineDeadError(RuntimeError):
    """The engine is not running (never started, stopped, or crashed)."""


class RequestAbortedError(RuntimeError):
    """The request was aborted before it produced anything."""


class QueueFullError(RuntimeError):
    """Too many requests are waiting; try again later."""


class EngineShuttingDownError(RuntimeError):
    """The engine is shutting down and accepts no new requests."""


class StatLogger(Protocol):
    """Hooks called after each engine iteration, on the thread that delivers outputs (the
    engine thread, or the receiver thread of an engine process)."""

    def on_step(self, now: float, outputs: list[RequestOutput | DecodedOutput]) -> None:
        """The step's outputs: RequestOutputs with the engine thread, DecodedOutputs with
        an engine process (request_id, finished, num_tokens and metrics are cheap there;
        `outputs` builds the whole output)."""

    def on_abort(self, request_id: str) -> None:
        """A live request was aborted (or failed) before it finished."""


class RequestStream:
    """The consumer side of one request: the items its engine owner delivered, on the
    consumer's event loop. A deque and one waiter future rather than an asyncio.Queue: a
    streamed chunk waits here once per step, and the queue's bookkeeping (a future per
    get, its wake-up list) was a visible part of the frontend's per-chunk CPU."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self.loop = loop
        # RequestOutputs (engine thread), DecodedOutputs (engine process) or an error.
        self._items: collections.deque[RequestOutput | DecodedOutput | BaseException] = \
            collections.deque()
        self._waiter: asyncio.Future | None = None
        self.finished = False  # the last item was taken (a finished output or an error)
        self._holds_reservation = False  # counts in the engine's waiting/in-flight numbers
        self.started = False   # the first output was delivered

    def _put(self, item: RequestOutput | DecodedOutput | BaseException) -> None:
        """On the stream's loop: queue an item and wake the consumer."""
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    async def _wait(self) -> None:
        while not self._items:
            waiter = self._waiter = self.loop.create_future()
            try:
                await waiter
            finally:
                if self._waiter is waiter:
                    self._waiter = None

    def _take(self, item: RequestOutput | DecodedOutput | BaseException
              ) -> RequestOutput | DecodedOutput:
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
        await self._wait()
        return materialize(self._take(self._items.popleft()))

    async def get_latest_item(self) -> RequestOutput | DecodedOutput:
        """Wait for an output, then skip to the newest one already queued, without
        building it: a DecodedOutput (engine process; `materialize()` builds it) or a
        RequestOutput. Outputs are cumulative (full text, all tokens and logprobs so far),
        so nothing is lost. A finished output or an error is never skipped."""
        if self.finished:
            raise StopAsyncIteration
        await self._wait()
        items = self._items
        item = items.popleft()
        while items and not isinstance(item, BaseException) and not item.finished:
            item = items.popleft()
        return self._take(item)

    async def get_latest(self) -> RequestOutput:
        """get_latest_item(), built into its RequestOutput."""
        return materialize(await self.get_latest_item())

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        return await self.get()


def _nothing(_engine) -> None:
    """A call whose answer carries the engine's snapshot (refresh_snapshot)."""


class AsyncLLMEngine:
    """Owns an LLMEngine. Build with an EngineConfig (the engine is built by its owner) or
    an existing LLMEngine (handed over: stop using it; thread only). engine_process=True
    runs the engine in a process of its own ('spawn'); then submit()/call() take only
    picklable functions and `engine` is None here. extra_frontends=N (with the process)
    makes the engine serve N more frontends: `frontend_connections` holds their ends, for
    AsyncLLMEngine.attach() in other processes (`minivllm serve --api-servers`)."""

    def __init__(self, engine: EngineConfig | LLMEngine | None, *,
                 max_waiting_requests: int | None = None,
                 stat_loggers: list[StatLogger] | None = None,
                 start: bool = True, engine_process: bool = False,
                 extra_frontends: int = 0, _attach_to=None) -> None:
        if max_waiting_requests is not None and max_waiting_requests < 1:
            raise ValueError("max_waiting_requests must be at least 1 (or None: no limit).")
        if engine_process and isinstance(engine, LLMEngine):
            raise ValueError("An existing LLMEngine cannot move to another process: pass "
                             "its EngineConfig.")
        if extra_frontends and not engine_process:
            raise ValueError("extra_frontends needs engine_process=True.")
        self._config_or_engine = engine
        self.engine: LLMEngine | None = engine if isinstance(engine, LLMEngine) else None
        # The EngineConfig the engine is built from (None in a frontend attached to
        # another process's engine).
        self.config: EngineConfig | None = (engine.config if isinstance(engine, LLMEngine)
                                            else engine)
        self.engine_process = engine_process
        self.max_waiting_requests = max_waiting_requests
        self.stat_loggers: list[StatLogger] = list(stat_loggers or [])
        # Commands to the engine owner (thread: a list under _cv; process: a pipe).
        self._cv = threading.Condition()
        self._commands: list[tuple] = []
        self._stop = False
        self._thread: threading.Thread | None = None  # engine thread, or receiver thread
        self._process = None
        self._conn = _attach_to  # the connection to an engine process (None: a thread)
        self._extra_frontends = extra_frontends
        # Other frontends send requests to the same engine process (--api-servers N).
        self._shares_engine = bool(extra_frontends) or _attach_to is not None
        self.frontend_connections: list = []
        self._send_lock = threading.Lock()
        self._ready = threading.Event()
        self._init_error: BaseException | None = None
        self.dead_error: BaseException | None = None
        self._accepting = True
        # Frontend state (event loops), under _count_lock.
        self._count_lock = threading.Lock()
        self._num_not_started = 0
        self._num_in_flight = 0
        # Requests and calls waiting for the engine's answer, and live streams. Written by
        # the callers (under _lock) and by the delivering thread.
        self._lock = threading.Lock()
        self._adding: dict[str, tuple[RequestStream, asyncio.Future]] = {}
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._call_ids = itertools.count()
        self._streams: dict[str, RequestStream] = {}
        # Published after each engine iteration; read by anyone.
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
        """Start the engine (building it) and wait until it is ready; an error while
        building the engine is raised here."""
        self.launch()
        if not self._ready.wait(timeout):
            raise TimeoutError("The engine did not start in time.")
        if self._init_error is not None:
            raise self._init_error
        return self

    def launch(self) -> "AsyncLLMEngine":
        """Start building the engine (its thread or process) without waiting for it. With
        an engine process, `frontend_connections` are ready for other frontends once this
        returns: they can attach while the model loads."""
        if self._thread is None:
            if self._conn is not None:  # attached to an engine process started elsewhere
                self._start_receiver()
            elif self.engine_process:
                self._start_process()
            else:
                # The engine thread and the event loop share the GIL; at the default 5 ms
                # switch interval a decode step can wait a whole interval for it.
                sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
                self._thread = threading.Thread(target=self._thread_main,
                                                name="minivllm-engine", daemon=True)
                self._thread.start()
        return self

    @classmethod
    def attach(cls, connection, *, max_waiting_requests: int | None = None,
               stat_loggers: list[StatLogger] | None = None) -> "AsyncLLMEngine":
        """A frontend of an engine process started by another AsyncLLMEngine (one of its
        `frontend_connections`, passed to this process)."""
        return cls(None, max_waiting_requests=max_waiting_requests, stat_loggers=stat_loggers,
                   engine_process=True, _attach_to=connection)

    @property
    def is_running(self) -> bool:
        alive = self._thread is not None and self._thread.is_alive()
        if self._process is not None:
            alive = alive and self._process.is_alive()
        return (alive and self._ready.is_set() and self._init_error is None
                and self.dead_error is None)

    @property
    def accepting(self) -> bool:
        return self._accepting and self.is_running

    @property
    def num_in_flight(self) -> int:
        """Requests added through this object and not yet finished (event-loop count)."""
        return self._num_in_flight

    async def shutdown(self, drain_timeout: float = 0.0) -> None:
        """Stop admitting requests, let in-flight ones finish for up to drain_timeout
        seconds, abort the rest and stop the engine."""
        self._accepting = False
        deadline = time.monotonic() + max(0.0, drain_timeout)
        while self.is_running and time.monotonic() < deadline and (
                self._num_in_flight or (not self._shares_engine
                                        and self.snapshot.get("num_unfinished", 0))):
            # Sharing the engine, only this frontend's own requests count: the engine's
            # count includes the others', and this frontend's snapshot of it stops being
            # updated once none of its own requests run (a stale count held every
            # shutdown for the whole drain timeout).
            await asyncio.sleep(0.02)
        await asyncio.get_running_loop().run_in_executor(None, self.stop)

    def stop(self, timeout: float | None = 30.0) -> None:
        """Abort whatever is in flight and stop the engine (blocking; any thread). With
        several frontends, the engine process ends once every one of them has stopped."""
        self._accepting = False
        if self._conn is not None:
            with self._send_lock:
                already, self._stop = self._stop, True
                if not already:
                    try:
                        self._conn.send(("stop",))
                    except (OSError, ValueError):
                        pass
            if self._thread is not None and self._thread is not threading.current_thread():
                self._thread.join(timeout)
            if self._process is not None and not self._extra_frontends:
                self._process.join(5 if timeout is None else min(timeout, 5))
                if self._process.is_alive():
                    self._process.terminate()
                    self._process.join(5)
            return
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    # ---- commands (any thread) ----------------------------------------------------------

    def _send(self, command: tuple) -> None:
        if self._conn is not None:
            with self._send_lock:
                if self._stop:
                    raise EngineDeadError("The engine has stopped.")
                try:
                    self._conn.send(command)
                except (OSError, ValueError) as e:
                    raise EngineDeadError(f"The engine process is gone: {e!r}") from e
            return
        with self._cv:
            if self._stop:
                raise EngineDeadError("The engine has stopped.")
            self._commands.append(command)
            self._cv.notify()

    def _check_alive(self) -> None:
        if self._init_error is not None:
            raise EngineDeadError(f"The engine failed to start: {self._init_error}")
        if self.dead_error is not None:
            raise EngineDeadError(f"The engine died: {self.dead_error}")
        if not self.is_running:
            raise EngineDeadError("The engine is not running.")

    def submit(self, fn: Callable[[LLMEngine], Any]) -> concurrent.futures.Future:
        """Run fn(engine) on the engine side between steps; a Future of its result."""
        self._check_alive()
        payload: Any = fn
        if self._conn is not None:
            try:
                payload = pickle.dumps(fn)
            except Exception as e:  # noqa: BLE001
                raise TypeError("With engine_process=True the function must be picklable "
                                f"(a module-level function): {e}") from e
        fut: concurrent.futures.Future = concurrent.futures.Future()
        call_id = next(self._call_ids)
        with self._lock:
            self._calls[call_id] = fut
        try:
            self._send(("call", call_id, payload))
        except BaseException:
            with self._lock:
                self._calls.pop(call_id, None)
            raise
        return fut

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Await fn(engine), run on the engine side between steps."""
        return await asyncio.wrap_future(self.submit(fn))

    async def refresh_snapshot(self) -> dict:
        """The engine's current snapshot. Sharing the engine with other frontends, this
        one hears of it only while its own requests run, so it asks (one round trip
        between steps); otherwise the snapshot it has is current."""
        if self._shares_engine and self.is_running:
            try:
                await self.call(_nothing)
            except EngineDeadError:
                pass  # stopped meanwhile: the last snapshot is all there is
        return self.snapshot

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
            rid = spec["request_id"]
            stream = RequestStream(rid, loop)
            stream._holds_reservation = True
            accepted = loop.create_future()
            accepted.add_done_callback(
                lambda f, stream=stream: self._on_add_settled(f, stream))
            try:
                with self._lock:
                    if rid in self._adding or rid in self._streams:
                        raise ValueError(f"Request id {rid!r} is already in use.")
                    self._adding[rid] = (stream, accepted)
                try:
                    self._send(("add", rid, spec.get("prompt"), spec["params"],
                                spec.get("prompt_token_ids"), spec.get("arrival_time") or now))
                except BaseException:
                    with self._lock:
                        self._adding.pop(rid, None)
                    raise
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

    # ---- delivery -----------------------------------------------------------------------

    def _deliver(self, items: list[tuple[RequestStream, Any]],
                 then: Callable[[], None] | None = None) -> None:
        """On the stream's event loop: queue the items and settle the reservations; then
        `then()` (the engine process's acknowledgement: sent whatever happens here, or
        the engine would hold this frontend's outputs for good)."""
        try:
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
                stream._put(item)
        finally:
            if then is not None:
                then()

    def _dispatch(self, events: list, snapshot: dict, outputs: list | None,
                  then: Callable[[], None] | None = None) -> None:
        """One engine iteration's events -> futures, streams and stat loggers. Runs on the
        engine thread or the receiver thread (one of them, never both). `then` runs once
        the streams' event loop has taken the outputs (at once if there are none)."""
        # Publish before delivering, so a client that got its last token reads metrics
        # that already count it.
        self.snapshot = snapshot
        deliveries: list[tuple[RequestStream, Any]] = []
        for ev in events:
            kind = ev[0]
            if kind == "output":
                out = ev[1]
                stream = self._streams.get(out.request_id)
                if stream is not None:
                    deliveries.append((stream, out))
                    if out.finished:
                        del self._streams[out.request_id]
            elif kind == "added":
                _, rid, error = ev
                with self._lock:
                    stream, accepted = self._adding.pop(rid)
                    if error is None:
                        self._streams[rid] = stream
                _resolve(stream.loop, accepted, error=error)
            elif kind == "aborted":
                _, rid, final, live = ev
                if live:
                    for sl in self.stat_loggers:
                        _safe(sl.on_abort, rid)
                stream = self._streams.pop(rid, None)
                if stream is not None:
                    deliveries.append((stream, final if final is not None
                                       else RequestAbortedError(f"Request {rid} was aborted.")))
            elif kind == "failed":
                _, rid, error = ev
                for sl in self.stat_loggers:
                    _safe(sl.on_abort, rid)
                stream = self._streams.pop(rid, None)
                if stream is not None:
                    deliveries.append((stream, error))
            elif kind == "called":
                _, call_id, error, value = ev
                with self._lock:
                    fut = self._calls.pop(call_id, None)
                if fut is not None and fut.set_running_or_notify_cancel():
                    if error is not None:
                        fut.set_exception(error)
                    else:
                        fut.set_result(value)
        if outputs is not None:
            now = time.monotonic()
            for sl in self.stat_loggers:
                _safe(sl.on_step, now, outputs)
        self._flush(deliveries, then)

    def _flush(self, deliveries: list, then: Callable[[], None] | None = None) -> None:
        """Hand outputs to their event loops: one call_soon_threadsafe per loop; `then`
        after the last loop's."""
        if not deliveries:
            if then is not None:
                then()
            return
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for stream, item in deliveries:
            by_loop.setdefault(stream.loop, []).append((stream, item))
        last = len(by_loop) - 1
        for i, (loop, items) in enumerate(by_loop.items()):
            try:
                loop.call_soon_threadsafe(self._deliver, items, then if i == last else None)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                pass

    def _fail_all(self, error: BaseException) -> None:
        """The engine is gone: every stream, pending add and pending call gets `error`."""
        with self._cv:
            self._stop = True
            self._commands = []
        with self._lock:
            streams, self._streams = self._streams, {}
            adding, self._adding = self._adding, {}
            calls, self._calls = self._calls, {}
        self._flush([(s, error) for s in streams.values()])
        for stream, accepted in adding.values():
            _resolve(stream.loop, accepted, error=error)
        for fut in calls.values():
            if fut.set_running_or_notify_cancel():
                fut.set_exception(error)

    def _set_facts(self, facts: dict) -> None:
        self.tokenizer = facts["tokenizer"]
        self.model_path = facts["model_path"]
        self.max_model_len = facts["max_model_len"]
        self.vocab_size = facts["vocab_size"]
        self.eos_token_ids = facts["eos_token_ids"]
        if "snapshot" in facts:
            self.snapshot = facts["snapshot"]

    # ---- owner 1: the engine thread -----------------------------------------------------

    def _thread_main(self) -> None:
        try:
            if self.engine is None:
                self.engine = LLMEngine(self._config_or_engine)  # type: ignore[arg-type]
            core = EngineCore(self.engine)
            facts = engine_facts(self.engine)
            # The tokenizer is used by both threads: the frontend gets its own copy.
            facts["tokenizer"] = copy.deepcopy(facts["tokenizer"])
            self._set_facts(facts)
            self.snapshot = core.snapshot()
        except BaseException as e:  # noqa: BLE001 - reported to start()
            self._init_error = e
            self._ready.set()
            return
        self._ready.set()
        try:
            self._thread_loop(core)
        except BaseException as e:  # noqa: BLE001 - must not vanish silently
            logger.exception("The engine thread died")
            self.dead_error = e
            self._fail_all(EngineDeadError(f"The engine thread died: {e!r}"))

    def _thread_loop(self, core: EngineCore) -> None:
        while True:
            with self._cv:
                while not self._commands and not self._stop and not core.has_work():
                    self._cv.wait()
                commands, self._commands = self._commands, []
                stop = self._stop
            events: list = []
            for command in commands:
                core.apply(command, events)
            if stop:
                core.abort_all(events)
                self._dispatch(events, core.snapshot(), None)
                self._fail_all(EngineDeadError("The engine has stopped."))  # late commands
                return
            outputs = core.step(events) if core.has_work() else None
            if events or commands or outputs is not None:
                self._dispatch(events, core.snapshot(), outputs)

    # ---- owner 2: an engine process, and the thread receiving its events ----------------

    def _start_process(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        pipes = [ctx.Pipe(duplex=True) for _ in range(1 + self._extra_frontends)]
        level = logging.getLogger().getEffectiveLevel()
        # Not a daemon when other frontends share it (it must outlive this one's stop()) or
        # when it starts tensor-parallel workers (a daemon may not have children).
        workers = self._config_or_engine.tensor_parallel_size > 1
        self._process = ctx.Process(target=engine_process_main, name="minivllm-engine",
                                    args=(self._config_or_engine,
                                          [child for _, child in pipes], level),
                                    daemon=not (self._extra_frontends or workers))
        self._process.start()
        for _, child in pipes:
            child.close()
        self._conn = pipes[0][0]
        if workers and not self._extra_frontends:
            # At exit, before multiprocessing joins its children: the engine process
            # stops once this end of its pipe closes.
            multiprocessing.util.Finalize(self, self._conn.close, exitpriority=0)
        self.frontend_connections = [parent for parent, _ in pipes[1:]]
        self._start_receiver()

    def _start_receiver(self) -> None:
        # The receiver thread and the event loop share the GIL: at Python's default 5 ms
        # switch interval, each socket write of the loop (which releases the GIL) could
        # wait up to 5 ms to get it back while the receiver decodes a step's outputs.
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        self._thread = threading.Thread(target=self._receive_main, name="minivllm-receiver",
                                        daemon=True)
        self._thread.start()

    def _receive_main(self) -> None:
        set_os_thread_name("mv-receiver")
        conn = self._conn
        try:
            first = conn.recv()
        except (EOFError, OSError) as e:
            self._init_error = EngineDeadError(f"The engine process died while starting: {e!r}")
            self._ready.set()
            return
        if first[0] != "ready":
            self._init_error = first[1] if first[0] == "init_error" else RuntimeError(first)
            self._ready.set()
            return
        self._set_facts(first[1])
        self._ready.set()
        decoder = OutputDecoder()
        try:
            while True:
                msg = conn.recv()
                if msg[0] == "events":
                    _, wire, snapshot, stepped = msg
                    events = decode_events(wire, decoder)
                    outputs = [ev[1] for ev in events if ev[0] == "output"] if stepped else None
                    self._dispatch(events, snapshot, outputs, self._acknowledge)
                elif msg[0] == "stopped":
                    self._fail_all(EngineDeadError("The engine has stopped."))
                    return
                elif msg[0] == "dead":
                    raise msg[1]
        except BaseException as e:  # noqa: BLE001 - the process died or broke the protocol
            if not self._stop:
                logger.error("The engine process died: %r", e)
                self.dead_error = e
            self._fail_all(EngineDeadError(f"The engine process died: {e!r}"))
        finally:
            try:
                conn.close()
            except OSError:
                pass

    def _acknowledge(self) -> None:
        """Tell the engine process that this frontend took its last message (its flow
        control: engine_process.run_engine_process)."""
        try:
            self._send(("ack",))
        except EngineDeadError:
            pass


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
