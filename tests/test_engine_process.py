"""The engine in a process of its own (AsyncLLMEngine(engine_process=True), `minivllm serve`'s
default): outputs rebuilt from deltas equal the in-thread engine's, functions cross only
when picklable, and a dead engine process fails its requests instead of hanging them."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest

from minivllm.config import EngineConfig
from minivllm.engine.async_llm_engine import AsyncLLMEngine, EngineDeadError
from minivllm.engine.engine_core import engine_idle
from minivllm.sampling_params import SamplingParams
from minivllm.server.testing import ServerThread, make_tiny_chat_model


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    return make_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat-process"))


def _config(model_dir, **kw) -> EngineConfig:
    return EngineConfig(model=str(model_dir), max_model_len=512, max_num_seqs=16,
                        num_kv_blocks=512, **kw)


# Requests whose outputs exercise every field the delta encoding carries: logprobs, prompt
# logprobs (over chunked-free prefill), n > 1, stop strings that cut text, seeds.
REQUESTS = [
    ("Once upon a time, in a land far away, there lived a cat who liked long stories "
     "about other cats", SamplingParams(temperature=0.0, max_tokens=20, logprobs=2,
                                        prompt_logprobs=1)),
    ("The list: 1, 2, 3,", SamplingParams(temperature=0.8, seed=7, n=3, max_tokens=16)),
    ("Say hello", SamplingParams(temperature=0.0, max_tokens=24, stop=[" the", "."],
                                 include_stop_str_in_output=False)),
    ([1, 5, 9, 200, 3000], SamplingParams(temperature=1.0, seed=3, max_tokens=12,
                                          logprobs=0, ignore_eos=True)),
]


async def _collect(engine: AsyncLLMEngine) -> list:
    async def one(i, prompt, params):
        outs = []
        kw = {"prompt_token_ids": prompt} if isinstance(prompt, list) else {}
        async for out in engine.generate(None if kw else prompt, params, f"r{i}", **kw):
            outs.append(out)
        return outs
    return await asyncio.gather(*(one(i, p, sp) for i, (p, sp) in enumerate(REQUESTS)))


def _view(out):
    return (out.request_id, out.prompt, out.prompt_token_ids, out.finished,
            out.prompt_logprobs, out.num_cached_tokens,
            [(o.index, o.text, o.token_ids, o.cumulative_logprob, o.logprobs, o.finish_reason,
              o.stop_reason) for o in out.outputs])


def _same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= 1e-4 * max(1.0, abs(a))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if hasattr(a, "__dataclass_fields__") and type(a) is type(b):
        return all(_same(getattr(a, f), getattr(b, f)) for f in a.__dataclass_fields__)
    return a == b


# The second run chunks every prefill (16-token budget): prompt logprobs then arrive over
# several steps and cross the pipe as several deltas. The first run's engine process also
# writes its step trace (MINIVLLM_ENGINE_TRACE), checked in _check_step_trace.
@pytest.mark.parametrize("budget", [None, 16])
def test_process_outputs_equal_thread_outputs(chat_dir, budget, tmp_path, monkeypatch):
    finals = {}
    kw = {"max_num_batched_tokens": budget} if budget else {}
    trace = tmp_path / "trace.json"
    for process in (False, True):
        if process and budget is None:
            monkeypatch.setenv("MINIVLLM_ENGINE_TRACE", str(trace))
        engine = AsyncLLMEngine(_config(chat_dir, **kw), engine_process=process)
        monkeypatch.delenv("MINIVLLM_ENGINE_TRACE", raising=False)
        try:
            t0 = time.monotonic()
            streams = asyncio.run(_collect(engine))
            t1 = time.monotonic()
            assert engine.submit(engine_idle).result(10)
            if process:
                assert engine.engine is None and engine._process.is_alive()
                with pytest.raises(TypeError, match="picklable"):
                    engine.submit(lambda e: 1)
            assert engine.tokenizer is not None and engine.max_model_len == 512
        finally:
            engine.stop()
        if process:
            assert not engine._process.is_alive()
        # Every intermediate output is cumulative and grows; the final ones are compared.
        for outs in streams:
            for a, b in zip(outs, outs[1:]):
                for x, y in zip(a.outputs, b.outputs):
                    assert y.text.startswith(x.text)
                    assert y.token_ids[:len(x.token_ids)] == x.token_ids
        finals[process] = [_view(outs[-1]) for outs in streams]
    # Exact but for floats: requests reach the engine at times that differ between runs,
    # so batches (and the CPU GEMMs' rounding) differ and logprobs move in the 7th digit.
    assert _same(finals[True], finals[False])
    assert finals[True][0][4] is not None and len(finals[True][1][6]) == 3
    # prompt_logprobs: one entry per prompt token (None for the first), all of them.
    assert len(finals[True][0][4]) == len(finals[True][0][2]) > 16
    if budget is None:
        _check_step_trace(trace, t0, t1)


def test_engine_process_start_error_is_raised(tmp_path):
    with pytest.raises(Exception, match="missing|not found|No such|does not exist"):
        AsyncLLMEngine(EngineConfig(model=str(tmp_path / "missing")), engine_process=True)


def test_killed_engine_process_fails_requests_and_health(chat_dir):
    with ServerThread(dict(model=str(chat_dir), max_model_len=1024, num_kv_blocks=512),
                      served_model_names=["tiny"], engine_process=True) as s:
        with httpx.Client(base_url=s.url, timeout=30) as h:
            assert h.get("/health").status_code == 200
            body = {"model": "tiny", "prompt": "never ending", "max_tokens": 1000,
                    "ignore_eos": True, "stream": True, "temperature": 0.0}
            lines = []
            with h.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        lines.append(line[6:])
                        if len(lines) == 1:
                            os.kill(s.engine._process.pid, signal.SIGKILL)
            assert lines[-1] == "[DONE]" and '"error"' in lines[-2]
            deadline = time.monotonic() + 10
            while h.get("/health").status_code == 200 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert h.get("/health").status_code == 503
            r = h.post("/v1/completions", json={"model": "tiny", "prompt": "hi",
                                                "max_tokens": 2})
            assert r.status_code >= 500 and "error" in r.json()
        with pytest.raises(EngineDeadError):
            s.engine.submit(engine_idle)


def _check_step_trace(path, t0: float, t1: float) -> None:
    """MINIVLLM_ENGINE_TRACE: the engine process (it served REQUESTS between t0 and t1)
    wrote its loop's trace when it ended; the benchmark's summary counts every added
    request and names each step's path."""
    from bench import engine_trace

    trace = engine_trace.load(path)
    whole = engine_trace.summarize(trace)
    assert whole["adds"] == len(REQUESTS)  # one add per request
    assert whole["add_arrival_to_engine_ms_mean"] >= 0
    steps = sum(v["count"] for v in whole["by_path"].values())
    assert steps == whole["iterations"] > 0
    # On the CPU every launched step is eager (no graphs); a token was sampled each time.
    assert set(whole["by_path"]) <= {"eager", "no_launch"}
    assert whole["by_path"]["eager"]["tokens_mean"] >= 1
    window = engine_trace.summarize(trace, t0, t1)
    assert 0 < window["iterations"] <= whole["iterations"]
    assert engine_trace.summarize(trace, t1 + 100, t1 + 200) == {"iterations": 0}


MAX_UNANSWERED = 2  # config.max_unanswered_outputs()'s default


def _raw_engine_process(chat_dir):
    """The engine process on a pipe end of its own (no AsyncLLMEngine), once ready."""
    import multiprocessing

    from minivllm.engine.engine_process import engine_process_main

    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe(duplex=True)
    config = EngineConfig(model=str(chat_dir), max_model_len=4096, max_num_seqs=4,
                          num_kv_blocks=300)
    proc = ctx.Process(target=engine_process_main, args=(config, [child]), daemon=True)
    proc.start()
    child.close()
    assert parent.poll(120) and parent.recv()[0] == "ready"
    return parent, proc


def _stop_raw(parent, proc) -> None:
    parent.send(("stop",))
    while parent.poll(30) and parent.recv()[0] != "stopped":
        pass
    proc.join(30)
    if proc.is_alive():
        proc.kill()


def test_outputs_wait_for_the_frontend_to_answer(chat_dir):
    """Flow control over the raw pipe: with MAX_UNANSWERED (2) messages unanswered, a
    frontend's new outputs wait in the engine process until it answers ("ack"); then one
    message carries each waiting request once, with every token since its last message."""
    from minivllm.engine.output_codec import OutputDecoder, decode_events

    parent, proc = _raw_engine_process(chat_dir)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        parent.send(("add", "r0", None, params, [1, 5, 9, 200], time.monotonic()))
        decoder = OutputDecoder()

        def outputs(msg):
            assert msg[0] == "events"
            return [ev[1] for ev in decode_events(msg[1], decoder) if ev[0] == "output"]

        sent = []  # the messages sent before any answer: MAX_UNANSWERED of them
        while parent.poll(3.0):  # the request runs to its end meanwhile
            sent.append(parent.recv())
        assert len(sent) == MAX_UNANSWERED and sent[0][1][0][0] == "added"
        got = [out for msg in sent for out in outputs(msg)]
        assert got and not got[-1].finished
        parent.send(("ack",))
        assert parent.poll(30)
        later = outputs(parent.recv())
        assert [o.request_id for o in later] == ["r0"] and later[0].finished
        final = later[0].outputs[0].token_ids
        assert len(final) == 12 and len(final) - len(got[-1].outputs[0].token_ids) >= 2
        assert final[:len(got[-1].outputs[0].token_ids)] == got[-1].outputs[0].token_ids
        # Aborted while its outputs wait: the abort's final output only, not a waiting
        # output that would read as finished.
        for _ in range(MAX_UNANSWERED):  # every message so far answered
            parent.send(("ack",))
        params = SamplingParams(temperature=0.0, max_tokens=4000, ignore_eos=True)
        parent.send(("add", "r1", None, params, [1, 5, 9, 200], time.monotonic()))
        sent = [parent.recv() for _ in range(MAX_UNANSWERED)]
        assert sent[0][1][0][:2] == ("added", "r1") and not parent.poll(0.2)
        parent.send(("abort", ["r1"]))
        assert parent.poll(30)
        events = parent.recv()[1]
        assert [ev[0] for ev in events] == ["aborted"] and events[0][1] == "r1"
    finally:
        _stop_raw(parent, proc)


def test_outputs_never_wait_with_max_unanswered_0(chat_dir, monkeypatch):
    """MINIVLLM_MAX_UNANSWERED=0 (an A/B's other side): every step's outputs are sent,
    answered or not."""
    monkeypatch.setenv("MINIVLLM_MAX_UNANSWERED", "0")
    parent, proc = _raw_engine_process(chat_dir)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        parent.send(("add", "r0", None, params, [1, 5, 9, 200], time.monotonic()))
        sent = []
        while parent.poll(3.0):
            sent.append(parent.recv())
        assert len(sent) >= 11  # "added" with the first token, then a message a step
    finally:
        _stop_raw(parent, proc)


def test_max_unanswered_must_be_a_whole_number(monkeypatch):
    from minivllm.config import max_unanswered_outputs

    assert max_unanswered_outputs() == MAX_UNANSWERED
    monkeypatch.setenv("MINIVLLM_MAX_UNANSWERED", "-1")
    with pytest.raises(ValueError, match="whole number"):
        max_unanswered_outputs()


def test_two_frontends_of_one_engine_process(chat_dir):
    """Two frontends of one engine process (`--api-servers 2`), one engine process for
    both checks: a request id already running through one is refused to the other, and the
    running request still gets every output; the other frontend gets the engine's current
    snapshot by asking. Then shutting one frontend down waits for its own requests, not for
    the other's (whose progress it no longer hears of), and leaves those running."""
    engine = AsyncLLMEngine(_config(chat_dir), engine_process=True, extra_frontends=1)
    other = AsyncLLMEngine.attach(engine.frontend_connections[0])
    try:
        params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)

        async def main():
            stream = engine.generate(None, params, "dup", prompt_token_ids=[1, 5, 9, 200])
            first = await stream.__anext__()
            with pytest.raises(ValueError, match="already in use"):
                async for _ in other.generate(None, params, "dup",
                                              prompt_token_ids=[1, 5, 9, 200]):
                    pass
            last = first
            async for last in stream:
                pass
            # `other` heard nothing of the request's end: asked, the engine says.
            stale = other.snapshot["num_unfinished"]
            return last, stale, await other.refresh_snapshot()

        last, stale, fresh = asyncio.run(asyncio.wait_for(main(), 60))
        assert last.finished and len(last.outputs[0].token_ids) == 40
        assert stale == 1 and fresh["num_unfinished"] == 0

        # Draining one frontend.
        async def run(frontend, rid, n):
            params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
            async for out in frontend.generate(None, params, rid,
                                               prompt_token_ids=[1, 5, 9, 200]):
                last = out
            return last

        async def drain():
            long = asyncio.ensure_future(run(other, "long", 400))
            assert (await run(engine, "short", 4)).finished
            start = time.monotonic()
            await engine.shutdown(drain_timeout=60)
            drained_in = time.monotonic() - start
            assert not long.done()
            return drained_in, await long

        drained_in, last = asyncio.run(asyncio.wait_for(drain(), 120))
        assert drained_in < 10  # not the drain timeout's 60 s
        assert last.finished and len(last.outputs[0].token_ids) == 400
    finally:
        other.stop()
        engine.stop()
