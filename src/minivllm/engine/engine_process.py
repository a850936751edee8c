"""The engine process: an EngineCore driven over a multiprocessing connection.

AsyncLLMEngine(engine_process=True) spawns `engine_process_main`; see engine_core.py for
why the server runs its engine in a process of its own, and output_codec.py for how
outputs travel.
"""

from __future__ import annotations

import logging
import time

from ..config import max_unanswered_outputs
from .engine_core import EngineCore
from .llm_engine import LLMEngine, freeze_startup_objects
from .output_codec import OutputEncoder, encode_events
from .step_trace import StepTrace

logger = logging.getLogger(__name__)


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


def run_engine_process(config, conns, log_level: int = logging.INFO) -> None:
    """Main of the engine process (multiprocessing 'spawn'). Serves one or more frontends,
    each over its own connection (a Pipe end): to each it sends ("ready", facts) |
    ("init_error", error) once, then ("events", wire_events, snapshot, stepped) for the
    loop iterations that concern it (its requests' events, answers to its commands), and
    ("stopped",) once it has said "stop". A request's events go to the frontend that added
    it; a frontend that stops or goes away has its requests aborted. The process ends
    when no frontend is left.

    Flow control: a frontend answers each "events" message with ("ack",) once its event
    loop has taken the message's outputs. While `max_unanswered` messages are unanswered
    (config.max_unanswered_outputs(): 2; 0 for never), that frontend's new outputs wait
    here (OutputBuffer); the next message carries each waiting request once, with every
    token since its last message. A frontend that keeps up gets every step; one that
    falls behind (hundreds of streams on one event loop) gets fewer, larger messages
    instead of a backlog of per-step ones to decode and deliver one by one. Events other
    than outputs (added, aborted, failed, called) go out at once."""
    import signal
    from multiprocessing.connection import wait

    conns = list(conns) if isinstance(conns, (list, tuple)) else [conns]
    # Ctrl-C reaches the whole process group: the frontends handle it and send "stop".
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level,
                        format="%(levelname)s %(asctime)s %(name)s [engine]: %(message)s")
    try:
        core = EngineCore(LLMEngine(config), report_requests=True)
        ready = ("ready", {**engine_facts(core.engine), "snapshot": core.snapshot()})
        freeze_startup_objects()  # this process lives exactly as long as its engine
    except BaseException as e:  # noqa: BLE001 - reported to the frontends
        if not isinstance(e, (ValueError, OSError)):  # a bad flag or path needs no traceback
            logger.exception("The engine failed to start")
        for conn in conns:
            _send_quietly(conn, ("init_error", _picklable_error(e)))
        return
    for conn in conns:
        _send_quietly(conn, ready)
    encoder = OutputEncoder()
    owner: dict[str, int] = {}  # request id -> index of the frontend that added it
    live = set(range(len(conns)))
    held = {k: OutputBuffer() for k in live}
    max_unanswered = max_unanswered_outputs() or float("inf")
    trace = StepTrace.from_env(config.data_parallel_rank)
    runner = getattr(core.engine, "runner", None)
    try:
        while live:
            if not core.has_work():
                wait([conns[k] for k in live])  # idle: sleep until a command arrives
            woke = time.monotonic() if trace else 0.0
            commands, leaving = [], []
            for k in sorted(live):
                try:
                    while conns[k].poll(0):
                        command = conns[k].recv()
                        if command[0] == "ack":
                            held[k].unanswered -= 1
                        else:
                            commands.append((k, command))
                except (EOFError, OSError):
                    leaving.append((k, False))  # gone without a word: nobody to answer
            out: dict[int, list] = {k: [] for k in live}
            spoke = {k for k, _ in commands}
            for k, command in commands:
                if command[0] == "stop":
                    leaving.append((k, True))
                    continue
                if command[0] == "add":
                    if trace:
                        trace.add_received(command[5])
                    events = []
                    core.apply(command, events)  # one ("added", id, error or None)
                    if events[-1][2] is None:
                        owner[command[1]] = k
                    # The answer goes to the asker, and only an accepted id changes owner:
                    # an id already in use (given twice, perhaps through two frontends)
                    # must not take the running request's outputs away.
                    out[k] += events
                    continue
                if command[0] == "call":
                    command = (*command[:2], _unpickle_call(command[2]))
                events: list = []
                core.apply(command, events)
                _route(events, owner, k, out)
            for k, answer in leaving:
                events = []
                for rid in [r for r, o in owner.items() if o == k]:
                    core.abort(rid, events)
                _route(events, owner, k, out)
                if answer:
                    _send_quietly(conns[k], ("events", _wire(held[k].take(out[k]), encoder),
                                             core.snapshot(), False))
                    _send_quietly(conns[k], ("stopped",))
                live.discard(k)
                out.pop(k, None)
            if not live:
                break
            events = []
            if trace and runner is not None:
                read, runner.last_step = time.monotonic(), None
            outputs = core.step(events) if core.has_work() else None
            if trace and runner is not None:
                trace.step(woke, read, time.monotonic(), len(commands),
                           runner.last_step if outputs is not None else None)
            _route(events, owner, None, out)
            snapshot = core.snapshot()
            busy = set(owner.values())
            for k in live:
                buf = held[k]
                buf.stepped |= outputs is not None
                if (buf.unanswered >= max_unanswered and k not in spoke
                        and buf.only_outputs(out[k])):
                    buf.hold(out[k])  # the frontend is behind on its messages
                elif out[k] or k in spoke or buf.waiting or (outputs is not None
                                                             and k in busy):
                    stepped, buf.stepped = buf.stepped, False
                    conns[k].send(("events", _wire(buf.take(out[k]), encoder), snapshot,
                                   stepped))
                    buf.unanswered += 1
        core.abort_all([])
    except (BrokenPipeError, ConnectionResetError):
        return  # a frontend went away mid-send; the others see EOF when this process ends
    except BaseException as e:  # noqa: BLE001 - must not vanish silently
        logger.exception("The engine process died")
        for conn in conns:
            _send_quietly(conn, ("dead", _picklable_error(e)))
    finally:
        if runner is not None and runner.tp is not None:
            runner.tp.stop()  # this process ends by os._exit, which runs no finalizers
        if trace:
            try:
                trace.dump()
            except OSError as e:
                logger.warning("Could not write the engine trace: %r", e)


class OutputBuffer:
    """One frontend's outputs waiting for it to answer its messages (see
    run_engine_process): the newest output event of each request, in the order they
    first waited. An output event names its Request, whose state only grows, so the one
    encoded last carries everything since the request's previous message."""

    def __init__(self) -> None:
        self.waiting: dict[str, tuple] = {}
        self.unanswered = 0    # messages sent and not yet answered with "ack"
        self.stepped = False   # a step ran since the last message (its outputs go to the
        # frontend's stat loggers)

    @staticmethod
    def only_outputs(events: list) -> bool:
        return all(ev[0] == "output" for ev in events)

    def hold(self, events: list) -> None:
        for ev in events:
            self.waiting[ev[1].request_id] = ev

    def take(self, events: list) -> list:
        """The waiting outputs, then `events` (this iteration's, in their order). A request
        with an output among `events` sends that one only, after anything this iteration
        did to it before (its "added" first); an aborted or failed one sends none (its
        final output or error says it all; encoded now, the waiting output would read as
        a finish)."""
        if not self.waiting:
            return events
        fresh = {ev[1].request_id if ev[0] == "output" else ev[1] for ev in events
                 if ev[0] in ("output", "aborted", "failed")}
        merged = [ev for rid, ev in self.waiting.items() if rid not in fresh] + events
        self.waiting = {}
        return merged


def _route(events: list, owner: dict[str, int], default: int | None,
           out: dict[int, list]) -> None:
    """Append each event to the list of the frontend it concerns (dropped when that
    frontend has left)."""
    for ev in events:
        kind = ev[0]
        if kind == "output":
            rid = ev[1].request_id
            k = owner.pop(rid, default) if ev[1].finished else owner.get(rid, default)
        elif kind in ("aborted", "failed"):
            k = owner.pop(ev[1], default)
        else:  # "called": the caller's
            k = default
        if k in out:
            out[k].append(ev)


def _send_quietly(conn, message) -> None:
    try:
        conn.send(message)
    except (OSError, ValueError):
        pass


def engine_process_main(config, conns, log_level: int = logging.INFO) -> None:
    """The engine process's target: run_engine_process, then leave without the
    interpreter's teardown (Triton's bindings print a wall of "leaked type" warnings from
    it; nothing is left to clean up once the frontend has been told "stopped")."""
    import os
    import sys

    from ..thread_names import set_os_thread_name

    set_os_thread_name("minivllm-engine")
    code = 0
    try:
        run_engine_process(config, conns, log_level)
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
