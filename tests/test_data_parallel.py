"""Data parallelism through the real server: two engine processes behind one frontend
share 64 requests, and when one is killed its requests end with an error while the other
keeps serving."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from minivllm.server.testing import ServerThread


@pytest.fixture(scope="module")
def server(tiny_text_model_dir):
    with ServerThread(dict(model=str(tiny_text_model_dir), max_model_len=256, max_num_seqs=16),
                      data_parallel_size=2) as s:
        yield s


async def _completions(url: str, count: int, max_tokens: int) -> list:
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        async def one(i: int):
            r = await client.post("/v1/completions", json={
                "prompt": f"Request number {i}:", "max_tokens": max_tokens,
                "temperature": 0.0, "ignore_eos": True})
            return r.status_code, r.json()
        return await asyncio.gather(*(one(i) for i in range(count)))


def test_requests_are_balanced_over_the_engines(server):
    engines = server.engine.replicas
    before = [e.snapshot.get("generation_tokens", 0) for e in engines]
    results = asyncio.run(_completions(server.url, 64, 8))
    assert all(status == 200 for status, _ in results)
    assert all(body["usage"]["completion_tokens"] == 8 for _, body in results)
    time.sleep(0.2)
    done = [e.snapshot.get("generation_tokens", 0) - b for e, b in zip(engines, before)]
    assert sum(done) == 64 * 8
    assert min(done) >= 64 * 8 // 4  # both served a fair share
    metrics = httpx.get(server.url + "/metrics").text
    assert "minivllm:generation_tokens_total" in metrics


def test_one_engine_dies_the_other_serves(server):
    engines = server.engine.replicas

    async def run():
        task = asyncio.create_task(_completions(server.url, 8, 240))
        while not engines[1].snapshot.get("num_requests_running"):
            await asyncio.sleep(0.01)  # until engine 1 decodes its share
        engines[1]._process.kill()
        return await task

    results = asyncio.run(run())
    failed = [r for r in results if r[0] != 200]
    ok = [r for r in results if r[0] == 200]
    assert failed and ok  # the killed engine's requests got an error, the others finished
    assert all("error" in body for _, body in failed)
    assert all(body["usage"]["completion_tokens"] == 240 for _, body in ok)
    deadline = time.monotonic() + 10
    while engines[1].is_running and time.monotonic() < deadline:
        time.sleep(0.1)
    again = asyncio.run(_completions(server.url, 8, 4))
    assert all(status == 200 for status, _ in again)  # all on the live engine
    assert httpx.get(server.url + "/health").status_code == 200
