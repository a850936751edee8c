"""RequestStream on its own: items in order with get(), skipping to the newest with
get_latest_item() but never past a finished output or an error, and a consumer cancelled
while waiting leaving the stream usable."""

from __future__ import annotations

import asyncio

import pytest

from minivllm.engine.async_llm_engine import RequestStream
from minivllm.engine.output_codec import (DecodedOutput, OutputDecoder, materialize,
                                          sample_outputs)
from minivllm.outputs import RequestOutput


def wire(rid: str, text: str, ids: list[int], finished: bool = False, first: bool = False):
    return (rid, ("p", [1, 2]) if first else None, False, None, (0.0, 0.0, 0.0, None), 0,
            None, finished, [(0, False, text, ids, None, None,
                              "length" if finished else None, None)])


def decoded(n: int, finish_at: int | None = None) -> list[DecodedOutput]:
    dec = OutputDecoder()
    return [dec.decode(wire("r", chr(97 + i), [10 + i], i == finish_at, i == 0))
            for i in range(n)]


def test_stream_get_takes_each_item_in_order():
    async def main():
        s = RequestStream("r", asyncio.get_running_loop())
        for item in decoded(3, finish_at=2):
            s._put(item)
        outs = [await s.get() for _ in range(3)]
        assert [o.outputs[0].text for o in outs] == ["a", "ab", "abc"]
        assert all(isinstance(o, RequestOutput) for o in outs)
        assert s.finished
        with pytest.raises(StopAsyncIteration):
            await s.get()
    asyncio.run(main())


def test_stream_get_latest_item_skips_to_the_newest_but_not_past_the_end():
    async def main():
        s = RequestStream("r", asyncio.get_running_loop())
        items = decoded(5, finish_at=3)
        for item in items[:2]:
            s._put(item)
        got = await s.get_latest_item()
        assert got is items[1] and not s.finished  # built only when asked
        assert [o.token_ids for o in sample_outputs(got)] == [[10, 11]]
        assert materialize(got).outputs[0].text == "ab"
        s._put(items[2])
        s._put(items[3])  # finished
        s._put(RuntimeError("after the end"))
        got = await s.get_latest_item()
        assert got is items[3] and got.finished and s.finished
        assert sample_outputs(got)[0].finish_reason == "length"
    asyncio.run(main())


def test_stream_error_is_not_skipped_and_raises():
    async def main():
        s = RequestStream("r", asyncio.get_running_loop())
        s._put(decoded(1)[0])
        s._put(ValueError("step failed"))
        s._put(decoded(2)[1])
        with pytest.raises(ValueError, match="step failed"):
            await s.get_latest_item()
        assert s.finished
    asyncio.run(main())


def test_stream_consumer_cancelled_while_waiting_leaves_it_usable():
    async def main():
        loop = asyncio.get_running_loop()
        s = RequestStream("r", loop)
        waiting = loop.create_task(s.get_latest())
        await asyncio.sleep(0)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert s._waiter is None
        item = decoded(1)[0]
        s._put(item)
        got = await asyncio.wait_for(s.get_latest(), 1)
        assert got.outputs[0].text == "a"
    asyncio.run(main())


def test_stream_wakes_a_waiting_consumer():
    async def main():
        loop = asyncio.get_running_loop()
        s = RequestStream("r", loop)
        waiting = loop.create_task(s.get_latest_item())
        await asyncio.sleep(0)
        assert not waiting.done()
        items = decoded(2, finish_at=1)
        loop.call_soon(s._put, items[0])
        loop.call_soon(s._put, items[1])
        assert (await asyncio.wait_for(waiting, 1)) in items
    asyncio.run(main())
