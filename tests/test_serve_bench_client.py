"""bench.serve_bench's client against a real minivllm server: one client process, and the
streams spread over several (what keeps the client from being the bottleneck on a GPU)."""

import asyncio

import pytest

from bench import serve_bench as sb
from minivllm.server.testing import ServerThread, make_tiny_chat_model


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = make_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat-bench"))
    with ServerThread(dict(model=str(model), max_model_len=512, num_kv_blocks=512),
                      served_model_names=["tiny"]) as s:
        yield s


@pytest.mark.parametrize("procs", [1, 2])
def test_level_counts_every_request_and_token(server, procs):
    t = sb.Target(label="minivllm", kind="minivllm", base_url=server.url + "/v1",
                  model="tiny")
    prompts = [f"prompt number {i}" for i in range(5)]
    level = asyncio.run(sb.run_level(t, prompts, concurrency=4, num_requests=10,
                                     output_tokens=6, timeout=60, headers={},
                                     client_procs=procs))
    assert level["completed"] == 10 and level["failures"] == 0, level["errors"]
    assert level["output_tokens"] == 60  # usage counts, ignore_eos forces the length
    assert level["client_procs"] == procs
    assert level["duration_s"] > 0 and level["ttft_ms_p50"] > 0
    assert ("client_cpu_s" in level) == (procs > 1)
    assert ("client_start_lag_ms" in level) == (procs > 1)
    if procs > 1:  # the pool's processes are kept for the next level and answer again
        again = asyncio.run(sb.run_level(t, prompts, concurrency=4, num_requests=4,
                                         output_tokens=3, timeout=60, headers={},
                                         client_procs=procs))
        assert again["completed"] == 4 and again["output_tokens"] == 12
        assert sb.client_pool(procs) is sb.client_pool(procs)


def test_server_metrics_sampler_reads_the_servers_view(server):
    t = sb.Target(label="minivllm", kind="minivllm", base_url=server.url + "/v1",
                  model="tiny")
    sampler = sb.ServerMetricsSampler(t, interval=0.02)
    level = asyncio.run(sampler.run(sb.run_level(
        t, ["a long story about a cat"], concurrency=4, num_requests=8, output_tokens=40,
        timeout=60, headers={})))
    assert level["completed"] == 8
    got = sampler.result
    # Server-side TTFT is measured from the handler's arrival, inside the client's TTFT.
    assert 0 < got["server_ttft_ms_mean"] <= level["ttft_ms_p99"] + 1
    assert got["server_e2e_ms_mean"] > 0 and got["server_queue_ms_mean"] >= 0
    assert 0 < got["server_intake_ms_mean"] < got["server_e2e_ms_mean"]
    assert 0 <= got["server_running_mean"] <= 4
    # A target without Prometheus metrics is left alone.
    other = sb.ServerMetricsSampler(sb.Target(label="x", kind="transformers",
                                              base_url=server.url + "/v1"))
    assert asyncio.run(other.run(asyncio.sleep(0, result=7))) == 7 and other.result == {}


def test_streams_are_read_to_the_end_so_connections_are_reused(server):
    """A client that stops reading at [DONE] makes httpx drop the connection, and every
    request then pays for a new one; real clients (openai) drain the stream."""
    import httpx

    t = sb.Target(label="minivllm", kind="minivllm", base_url=server.url + "/v1",
                  model="tiny")
    body = sb.request_body(t, "hello there", 4)

    async def two_requests():
        async with httpx.AsyncClient(timeout=60) as client:
            pool = client._transport._pool
            first = await sb.one_request(client, t.base_url + "/completions", body)
            conns = list(pool.connections)
            second = await sb.one_request(client, t.base_url + "/completions", body)
            return first, second, conns, list(pool.connections)

    first, second, after_first, after_second = asyncio.run(two_requests())
    assert first["ok"] and second["ok"], (first["error"], second["error"])
    assert first["usage_tokens"] == 4  # the usage chunk before [DONE] is still read
    assert len(after_first) == 1 and after_second == after_first
