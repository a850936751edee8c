"""AsyncLLMEngine: one engine thread, asyncio consumers, aborts, failures, limits, shutdown.

Runs the real engine on the tiny random Llama of conftest (token-id prompts, no tokenizer).
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from conftest import random_prompts
from minivllm.config import EngineConfig
from minivllm.engine.async_llm_engine import (AsyncLLMEngine, EngineShuttingDownError,
                                              EngineStepError, QueueFullError)
from minivllm.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def make_engine(model_dir, **kw) -> AsyncLLMEngine:
    cfg = dict(model=str(model_dir), skip_tokenizer_init=True, max_model_len=512,
               max_num_seqs=32, num_kv_blocks=256)
    cfg.update(kw.pop("config", {}))
    return AsyncLLMEngine(EngineConfig(**cfg), **kw)


@pytest.fixture(scope="module")
def llama_dir(tiny_model_dirs):
    return tiny_model_dirs["llama"]


@pytest.fixture(scope="module")
def engine(llama_dir):
    eng = make_engine(llama_dir)
    yield eng
    eng.stop()


class BatchSizes:
    """A stat logger that records how many requests each step advanced."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def on_step(self, now, outputs) -> None:
        self.sizes.append(len(outputs))

    def on_abort(self, request_id) -> None:
        pass


async def _final(eng: AsyncLLMEngine, prompt, params, rid):
    last = None
    async for out in eng.generate(prompt, params, rid):
        last = out
    return last


def _all_free(eng: AsyncLLMEngine) -> bool:
    return eng.submit(lambda e: e.scheduler.pool.all_free() and not e.requests).result(10)


def test_concurrent_requests_share_steps_and_match_alone(engine):
    prompts = random_prompts(16, 256, 4, 40, seed=1)
    sizes = BatchSizes()
    engine.stat_loggers.append(sizes)

    async def main():
        together = await asyncio.gather(
            *(_final(engine, p, GREEDY, f"c{i}") for i, p in enumerate(prompts)))
        alone = [await _final(engine, p, GREEDY, f"a{i}") for i, p in enumerate(prompts)]
        return together, alone

    try:
        together, alone = asyncio.run(main())
    finally:
        engine.stat_loggers.remove(sizes)
    for t, a in zip(together, alone):
        assert t.finished and t.outputs[0].finish_reason == "length"
        assert t.outputs[0].token_ids == a.outputs[0].token_ids
        assert len(t.outputs[0].token_ids) == 12
    assert max(sizes.sizes) > 1, "concurrent requests should land in the same step"
    assert _all_free(engine)


def test_outputs_are_cumulative_and_streamed(engine):
    async def main():
        seen = []
        async for out in engine.generate([5, 6, 7], GREEDY, "stream"):
            seen.append(list(out.outputs[0].token_ids))
        return seen

    seen = asyncio.run(main())
    assert len(seen) >= 2
    for a, b in zip(seen, seen[1:]):
        assert b[:len(a)] == a
    assert len(seen[-1]) == 12


def test_validation_errors_raise_before_streaming(engine):
    async def main():
        with pytest.raises(ValueError, match="out of vocabulary"):
            await engine.add_request("bad1", [1, 2, 10_000], GREEDY)
        with pytest.raises(ValueError, match="maximum context length"):
            await engine.add_request("bad2", [1] * 10, SamplingParams(max_tokens=600))
        with pytest.raises(ValueError, match="empty"):
            async for _ in engine.generate([], GREEDY, "bad3"):
                pass
        stream = await engine.add_request("dup", [1, 2, 3], SamplingParams(max_tokens=200,
                                                                           ignore_eos=True))
        with pytest.raises(ValueError, match="already in use"):
            await engine.add_request("dup", [1, 2, 3], GREEDY)
        engine.abort("dup")
        async for _ in stream:
            pass
        # The engine still serves.
        out = await _final(engine, [3, 4, 5], GREEDY, "after")
        return out

    out = asyncio.run(main())
    assert out.outputs[0].finish_reason == "length"
    assert _all_free(engine)
    assert engine._num_not_started == 0 and engine.num_in_flight == 0


def test_abort_frees_blocks_and_ends_stream(engine):
    async def main():
        stream = await engine.add_request(
            "long", [7] * 20, SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True))
        first = await stream.get()
        engine.abort("long")
        outs = [o async for o in stream]
        return first, outs

    first, outs = asyncio.run(main())
    assert not first.finished
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
    assert len(outs[-1].outputs[0].token_ids) < 400
    assert _all_free(engine)


def test_consumer_that_stops_reading_aborts(engine):
    async def main():
        agen = engine.generate([9, 9, 9], SamplingParams(max_tokens=400, ignore_eos=True),
                               "quitter")
        await agen.__anext__()
        await agen.aclose()  # what a disconnecting client's handler does

        async def cancelled_consumer():
            async for _ in engine.generate([8, 8], SamplingParams(max_tokens=400,
                                                                  ignore_eos=True), "cancel"):
                pass

        task = asyncio.ensure_future(cancelled_consumer())
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(200):
            if await engine.call(lambda e: e.scheduler.pool.all_free() and not e.requests):
                return True
            await asyncio.sleep(0.01)
        return False

    assert asyncio.run(main())


def test_step_failure_fails_affected_requests_and_engine_keeps_serving(llama_dir):
    eng = make_engine(llama_dir)
    try:
        def arm(e):
            real = e.runner.execute
            calls = {"n": 0}

            def flaky(batch):
                calls["n"] += 1
                if calls["n"] == 3:
                    raise RuntimeError("injected failure")
                return real(batch)
            e.runner.execute = flaky
            return real

        real_execute = eng.submit(arm).result(10)

        async def main():
            params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
            results = await asyncio.gather(
                *(_final(eng, [4, 5, 6 + i], params, f"f{i}") for i in range(3)),
                return_exceptions=True)
            later = await _final(eng, [4, 5, 6], GREEDY, "later")
            return results, later

        results, later = asyncio.run(main())
        assert all(isinstance(r, EngineStepError) for r in results), results
        assert "injected failure" in str(results[0])
        assert later.outputs[0].finish_reason == "length"
        assert _all_free(eng)
        assert eng._num_not_started == 0 and eng.num_in_flight == 0
        eng.submit(lambda e: setattr(e.runner, "execute", real_execute)).result(10)
    finally:
        eng.stop()


def test_waiting_limit_raises_queue_full(llama_dir):
    eng = make_engine(llama_dir, max_waiting_requests=2, config=dict(max_num_seqs=1))
    try:
        async def main():
            long = SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)
            running = await eng.add_request("run", [1, 2, 3], long)
            await running.get()  # started: no longer waiting
            w1 = await eng.add_request("w1", [1, 2], long)
            w2 = await eng.add_request("w2", [1, 3], long)
            with pytest.raises(QueueFullError):
                await eng.add_request("w3", [1, 4], long)
            with pytest.raises(QueueFullError):  # batches are all or nothing
                await eng.add_requests([dict(request_id="b1", prompt=[1], params=long)])
            eng.abort(["run", "w1", "w2"])
            for s in (running, w1, w2):
                async for _ in s:
                    pass
            return await _final(eng, [1, 5], GREEDY, "ok")

        out = asyncio.run(main())
        assert out.outputs[0].finish_reason == "length"
        assert eng._num_not_started == 0 and eng.num_in_flight == 0
    finally:
        eng.stop()


def test_shutdown_aborts_in_flight_and_stops_thread(llama_dir):
    eng = make_engine(llama_dir)

    async def main():
        stream = await eng.add_request("s", [1, 2, 3], SamplingParams(max_tokens=450,
                                                                      ignore_eos=True))
        await stream.get()
        t0 = time.monotonic()
        await eng.shutdown(drain_timeout=0.2)
        outs = [o async for o in stream]
        with pytest.raises(EngineShuttingDownError):
            await eng.add_request("late", [1], GREEDY)
        return outs, time.monotonic() - t0

    outs, took = asyncio.run(main())
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
    assert took < 5
    assert not eng.is_running
    assert not any(t.name == "minivllm-engine" and t.is_alive() for t in threading.enumerate()
                   if t is eng._thread)


def test_engine_build_error_is_raised_by_the_constructor(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        AsyncLLMEngine(EngineConfig(model=str(tmp_path / "missing")))
