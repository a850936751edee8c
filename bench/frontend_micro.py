"""The frontend's own CPU per streamed request and per chunk, in one process, without
sockets, client or engine: a steady number to A/B frontend changes with on a small
machine (bench.frontend_cpu's end-to-end numbers moved by +-15% between identical runs on
a 2-core VM, where the engine and the client share the cores with the frontend).

The real FastAPI app (build_app: middleware, validation, OpenAIServing, SSE responses) and
the real AsyncLLMEngine frontend (RequestStreams, OutputDecoder, _dispatch with its
call_soon_threadsafe hand-off) run on one event loop; a fake engine answers each "add"
and then, once per step, sends every live request one token as the engine process's wire
messages, decoded and dispatched as the receiver thread does. ASGI `send` only collects
the bytes. Not counted: uvicorn's HTTP parsing and socket writes, pickling across the
pipe, the receiver thread's GIL hand-offs.

    OMP_NUM_THREADS=1 python -m bench.frontend_micro --concurrency 64 256 --requests 512
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import orjson

from minivllm.engine.async_llm_engine import AsyncLLMEngine
from minivllm.engine.output_codec import OutputDecoder, decode_events


class FakeEngine(AsyncLLMEngine):
    """The frontend half of AsyncLLMEngine; commands go to `pending`, not a process."""

    def __init__(self, tokenizer, max_model_len: int, vocab_size: int) -> None:
        super().__init__(None, start=False)
        self._set_facts({"tokenizer": tokenizer, "model_path": None,
                         "max_model_len": max_model_len, "vocab_size": vocab_size,
                         "eos_token_ids": frozenset()})
        self.pending: list[tuple] = []
        self.decoder = OutputDecoder()

    @property
    def is_running(self) -> bool:
        return True

    def _send(self, command: tuple) -> None:
        self.pending.append(command)

    async def shutdown(self, drain_timeout: float = 0.0) -> None:
        pass


async def drive(engine: FakeEngine, out_tokens: int, stop: asyncio.Event,
                steps_per_drain: int = 1) -> int:
    """The fake engine's loop: answer commands, then one token for every live request per
    step; after every `steps_per_drain` steps the event loop runs until it has nothing
    ready (more than 1: a frontend that falls behind the engine, each chunk carrying that
    many tokens, as on the H200)."""
    live: dict[str, int] = {}  # request id -> tokens sent
    steps = 0
    while not stop.is_set():
        commands, engine.pending = engine.pending, []
        wire = []
        for cmd in commands:
            if cmd[0] == "add":
                live[cmd[1]] = 0
                wire.append(("added", cmd[1], None))
            elif cmd[0] == "abort":
                for rid in cmd[1]:
                    if live.pop(rid, None) is not None:
                        wire.append(("aborted", rid, None, True))
        for rid in list(live):
            n = live[rid] = live[rid] + 1
            done = n >= out_tokens
            tid = 97 + n % 26  # a letter: one character of text per token
            wire.append(("output", (rid, ([], [1] * 8) if n == 1 else None, False, None,
                                    (0.0, 0.0, 0.0, None), 0, None, done,
                                    [(0, False, chr(tid), [tid], None, None,
                                      "length" if done else None, None)])))
            if done:
                del live[rid]
        if wire:
            events = decode_events(wire, engine.decoder)
            engine._dispatch(events, {"num_unfinished": len(live)},
                             [ev[1] for ev in events if ev[0] == "output"])
            steps += 1
            if steps % steps_per_drain:
                continue
        # Until the loop has nothing else ready (private, but plain asyncio's): every
        # stream took its item and its chunk went out, so a chunk carries one token.
        ready = asyncio.get_running_loop()._ready
        await asyncio.sleep(0)
        while ready:
            await asyncio.sleep(0)
    return steps


async def one_request(app, body: bytes) -> int:
    """One streamed POST /v1/completions through the ASGI app; returns its chunk count."""
    chunks = 0
    sent = False
    done = asyncio.Event()

    async def receive():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await done.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        nonlocal chunks
        if message["type"] == "http.response.start":
            if message["status"] != 200:
                raise RuntimeError(f"status {message['status']}")
        elif message.get("body"):
            chunks += 1
        if message["type"] == "http.response.body" and not message.get("more_body"):
            done.set()

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
             "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/completions", "raw_path": b"/v1/completions", "root_path": "",
             "query_string": b"", "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 1),
             "headers": [(b"host", b"127.0.0.1:8000"), (b"content-type", b"application/json"),
                         (b"content-length", str(len(body)).encode())]}
    await app(scope, receive, send)
    return chunks


async def level(app, engine, c: int, n: int, args) -> dict:
    bodies = [orjson.dumps({"model": "m", "prompt": "".join(
        "abcdefghijklmnopqrstuvwxyz0123456789"[(i * 7 + k) % 36]
        for k in range(args.prompt_tokens)), "max_tokens": args.output_tokens,
        "temperature": 0.0, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True}}) for i in range(n)]
    stop = asyncio.Event()
    driver = asyncio.ensure_future(drive(engine, args.output_tokens, stop,
                                         args.steps_per_drain))
    next_i = 0
    chunks = 0

    async def worker():
        nonlocal next_i, chunks
        while next_i < n:
            i, next_i = next_i, next_i + 1
            got = await one_request(app, bodies[i])  # not `chunks += await ...`: a race
            chunks += got

    cpu0, t0 = time.process_time(), time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(c)))
    cpu = time.process_time() - cpu0
    wall = time.perf_counter() - t0
    stop.set()
    steps = await driver
    return {"concurrency": c, "requests": n, "steps_per_drain": args.steps_per_drain,
            "chunks": chunks, "steps": steps,
            "cpu_s": round(cpu, 3), "wall_s": round(wall, 3),
            "us_per_request": round(1e6 * cpu / n, 1),
            "us_per_chunk": round(1e6 * cpu / chunks, 2)}


async def main_async(args) -> list[dict]:
    from transformers import AutoTokenizer

    from bench.frontend_cpu import prepare_model
    from minivllm.server.api_server import build_app

    folder = prepare_model(Path(args.work) / "smoke-qwen2-bytes")
    tok = AutoTokenizer.from_pretrained(folder)
    engine = FakeEngine(tok, 4096, len(tok))
    app = build_app(engine, served_model_names=["m"], max_num_seqs=256,
                    generation_config="vllm")
    try:  # as the server does once built
        from minivllm.server.launch import prepare_frontend_gc
        prepare_frontend_gc()
    except ImportError:  # a tree from before it (an A/B against an older commit)
        gc.collect()
        gc.freeze()
    await level(app, engine, 8, 16, args)  # warm-up
    out = []
    for c in args.concurrency:
        repeats = []
        for _ in range(args.repeats):
            lv = await level(app, engine, c, args.requests, args)
            repeats.append(lv)
            if args.verbose:
                print("[frontend_micro]  repeat:", json.dumps(lv), flush=True)
        # The median of the repeats, with all of them: on a shared VM they move by +-15%.
        summary = dict(sorted(repeats, key=lambda r: r["cpu_s"])[len(repeats) // 2])
        summary["repeats"] = repeats
        print("[frontend_micro]", json.dumps({k: v for k, v in summary.items()
                                               if k != "repeats"}), flush=True)
        out.append(summary)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[64, 256])
    p.add_argument("--requests", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "minivllm-frontend-cpu"))
    p.add_argument("--steps-per-drain", type=int, default=1,
                   help="Engine steps between two turns of the event loop (tokens per chunk).")
    p.add_argument("--verbose", action="store_true", help="Print every repeat.")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    levels = asyncio.run(main_async(args))
    if args.out:
        from bench.serve_bench import environment

        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"benchmark": "frontend_micro",
                                              "argv": argv if argv is not None else sys.argv[1:],
                                              "environment": environment(),
                                              "levels": levels}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
