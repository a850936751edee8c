"""The engine process: an EngineCore driven over a multiprocessing connection.

AsyncLLMEngine(engine_process=True) spawns `engine_process_main`; see engine_core.py for
why the server runs its engine in a process of its own, and output_codec.py for how
outputs travel.
"""

from __future__ import annotations

import logging

from .engine_core import EngineCore
from .llm_engine import LLMEngine
from .output_codec import OutputEncoder, encode_events

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
