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
    per_engine = [line for line in metrics.splitlines()
                  if line.startswith("minivllm:engine_generation_tokens_total{")]
    assert len(per_engine) == 2 and all('engine="' in line for line in per_engine)


def test_offline_replicas_split_the_prompts(tiny_model_dirs):
    """LLM(data_parallel_size=2): the prompts split over two engines give one engine's
    outputs, in order (greedy and seeded sampling)."""
    from minivllm import LLM, SamplingParams
    from conftest import random_prompts
    prompts = random_prompts(7, 256, 3, 30, seed=4)
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=8,
                             ignore_eos=True) for i in range(7)]
    kw = dict(skip_tokenizer_init=True, max_model_len=64)
    want = LLM(str(tiny_model_dirs["qwen2"]), **kw).generate(prompts, params, use_tqdm=False)
    llm = LLM(str(tiny_model_dirs["qwen2"]), data_parallel_size=2, **kw)
    # Unseeded samples are independent across the engines: each has a seed of its own,
    # else the k-th request of each (numbered alike) draws the same numbers.
    unseeded = llm.generate([prompts[0]] * 4, SamplingParams(temperature=1.0, max_tokens=8,
                                                             ignore_eos=True), use_tqdm=False)
    assert len({tuple(o.outputs[0].token_ids) for o in unseeded}) == 4
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert [o.prompt_token_ids for o in got] == prompts
    # reset_prefix_cache() reaches the replica too: a repeated prompt's full block was
    # cached in whichever engine ran it, and is not after the reset.
    full = [i for i, p in enumerate(prompts) if len(p) > 16]
    assert any(i >= 3 for i in full)  # the replica's share (prompts 3-6) holds one
    again = llm.generate(prompts, params, use_tqdm=False)
    assert all(again[i].num_cached_tokens == 16 for i in full)
    assert llm.reset_prefix_cache() is True
    after = llm.generate(prompts, params, use_tqdm=False)
    assert [o.num_cached_tokens for o in after] == [0] * 7


def test_a_shared_prefix_goes_to_the_engine_that_has_it(server):
    """Requests whose prompts start alike go to the engine that served the prefix while it
    is not much busier than the other, even when the other is less busy."""
    from minivllm.engine.data_parallel import PREFIX_TOKENS
    system = "You are a helpful assistant. " * 20
    assert len(server.engine.tokenizer.encode(system)) > PREFIX_TOKENS
    engines = server.engine.replicas

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            async def ask(prompt, n):
                r = await client.post("/v1/completions", json={
                    "prompt": prompt, "max_tokens": n, "ignore_eos": True})
                assert r.status_code == 200
            await ask(system + "First?", 2)       # the prefix's engine: the first, idle
            first = engines[0].snapshot.get("prompt_tokens", 0)
            before = [e.snapshot.get("prompt_tokens", 0) for e in engines]
            busy = asyncio.create_task(ask("A long unrelated request.", 200))
            while not engines[0].num_in_flight:
                await asyncio.sleep(0.01)
            for i in range(4):  # engine 1 is idle, engine 0 has the prefix
                await ask(system + f"Question {i}?", 2)
            await busy
            return first, before
    first, before = asyncio.run(run())
    time.sleep(0.2)
    grew = [e.snapshot.get("prompt_tokens", 0) - b for e, b in zip(engines, before)]
    assert first > 0 and grew[1] == 0 and grew[0] > 0


def test_one_engine_dies_the_other_serves(server):  # last: it kills engine 1
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


def test_replica_configs_give_each_engine_a_gpu_where_there_are_enough(monkeypatch):
    """One engine per GPU where the host has as many and the config names none; otherwise
    the engines share the device and split its memory share."""
    import torch

    from minivllm.config import EngineConfig
    from minivllm.engine.data_parallel import replica_configs

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    own = replica_configs(EngineConfig(device="cuda", gpu_memory_utilization=0.8), 2)
    assert [c.device for c in own] == ["cuda:0", "cuda:1"]
    assert [c.gpu_memory_utilization for c in own] == [0.8, 0.8]
    for cfg, size in [(EngineConfig(device="cuda", gpu_memory_utilization=0.8), 3),
                      (EngineConfig(device="cuda:1", gpu_memory_utilization=0.8), 2),
                      (EngineConfig(device="cpu", gpu_memory_utilization=0.8), 2)]:
        shared = replica_configs(cfg, size)
        assert [c.device for c in shared] == [cfg.device] * size
        assert all(abs(c.gpu_memory_utilization - 0.8 / size) < 1e-9 for c in shared)
    # Under tensor parallelism each engine takes as many GPUs as it has ranks.
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    own = replica_configs(EngineConfig(device="cuda", tensor_parallel_size=2), 2)
    assert [c.device for c in own] == ["cuda:0", "cuda:2"]
    shared = replica_configs(EngineConfig(device="cuda", tensor_parallel_size=4), 2)
    assert [c.device for c in shared] == ["cuda", "cuda"]
    # Each engine knows which it is: engine K > 0 writes its trace beside engine 0's.
    assert [c.data_parallel_rank for c in shared] == [0, 1]


def test_each_engine_writes_a_trace_of_its_own(monkeypatch, tmp_path):
    """Two engines given one MINIVLLM_ENGINE_TRACE path wrote the same file, and the
    benchmark read neither."""
    from minivllm.engine.step_trace import StepTrace

    monkeypatch.setenv("MINIVLLM_ENGINE_TRACE", str(tmp_path / "trace.json"))
    paths = [StepTrace.from_env(rank).path for rank in (0, 1, 2)]
    assert paths == [str(tmp_path / name) for name in
                     ("trace.json", "trace-dp1.json", "trace-dp2.json")]
