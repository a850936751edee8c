"""`minivllm serve --api-servers 2`: two HTTP server processes share the port and one engine
process; requests through either give the same tokens and are counted in /metrics
whichever process answers the scrape; a SIGINT to the main process alone still stops
every process and frees the port."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai

from bench.serve_bench import parse_prometheus
from minivllm.server.testing import make_tiny_chat_model, wait_until_healthy


def _start_two_api_servers(tmp_path, *flags, **popen):
    """(process, url, model): `minivllm serve --api-servers 2` on a tiny model (the last
    of repeated flags wins)."""
    model = make_tiny_chat_model(tmp_path / "tiny-chat")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "minivllm.server", "--model", str(model), "--port", str(port),
         "--max-model-len", "512", "--num-kv-blocks", "256", "--api-servers", "2",
         "--log-level", "warning", "--shutdown-timeout", "2", *flags],
        env={**os.environ, "OMP_NUM_THREADS": "1"}, **popen)
    return proc, f"http://127.0.0.1:{port}", model


def test_two_api_servers_share_one_engine(tmp_path):
    proc, url, model = _start_two_api_servers(tmp_path, stdout=subprocess.PIPE,
                                              stderr=subprocess.STDOUT)
    try:
        wait_until_healthy(url, proc)

        prompts = [f"Tell me about number {i % 4}" for i in range(16)]

        async def main():
            # A fresh connection per request, so the kernel spreads them over both
            # processes' accept() calls.
            async def one(p):
                async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="x",
                                              max_retries=0, timeout=60) as c:
                    r = await c.completions.create(model=model.name, prompt=p, max_tokens=12,
                                                   temperature=0.0)
                    return r.choices[0].text
            return await asyncio.gather(*(one(p) for p in prompts))

        texts = asyncio.run(main())
        for i in range(4):  # the same prompt gives the same greedy text, whoever served it
            assert len({texts[j] for j in range(i, 16, 4)}) == 1
        assert all(texts)
        # Streaming through either process ends with [DONE].
        for _ in range(4):
            with httpx.stream("POST", url + "/v1/completions", timeout=60, json={
                    "model": model.name, "prompt": "Once", "max_tokens": 5,
                    "stream": True}) as r:
                assert r.status_code == 200
                assert "data: [DONE]" in list(r.iter_lines())
        # /metrics counts every process's requests, whichever process answers the scrape
        # (a fresh connection each: both processes answer some).
        generated = set()
        for _ in range(8):
            text = httpx.get(url + "/metrics", headers={"Connection": "close"}).text
            m = parse_prometheus(text, "minivllm:")
            assert m["request_success_total"] == 20, text
            assert m["time_to_first_token_seconds_count"] == 20
            assert m["num_requests_running"] == 0
            generated.add(m["generation_tokens_total"])
        assert len(generated) == 1  # the engine's counters, current in either process
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
        with socket.socket() as sock:  # every process has let go of the port
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", int(url.rsplit(":", 1)[1])))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_two_api_servers_in_front_of_two_data_parallel_engines(tmp_path):
    """--api-servers 2 --data-parallel-size 2: each API process is attached to both
    engines and routes its own requests; both engines serve, every request completes, and
    SIGINT stops the five processes."""
    proc, url, model = _start_two_api_servers(tmp_path, "--data-parallel-size", "2",
                                              stdout=subprocess.PIPE,
                                              stderr=subprocess.STDOUT,
                                              start_new_session=True)
    try:
        wait_until_healthy(url, proc)
        assert len(_processes_in_session(proc.pid)) >= 4  # 2 API servers, 2 engines

        async def main():
            async def one(i):
                async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="x",
                                              max_retries=0, timeout=60) as c:
                    r = await c.completions.create(model=model.name, prompt=f"Count {i}",
                                                   max_tokens=6, temperature=0.0,
                                                   extra_body={"ignore_eos": True})
                    return r.usage.completion_tokens
            return await asyncio.gather(*(one(i) for i in range(24)))

        assert asyncio.run(main()) == [6] * 24
        text = httpx.get(url + "/metrics", headers={"Connection": "close"}).text
        per_engine = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                      if line.startswith("minivllm:engine_generation_tokens_total{")]
        assert len(per_engine) == 2 and sum(per_engine) == 24 * 6, text
        assert min(per_engine) > 0  # both engines served
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
        assert _session_left_after(proc.pid, 30) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        _kill_session(proc.pid)


def test_the_shared_socket_gives_connections_tcp_nodelay():
    """Without TCP_NODELAY a stream's first chunk waited for the client's delayed ACK
    (~40 ms a request through --api-servers 2)."""
    from minivllm.server.launch import _listening_socket

    async def main():
        sock = _listening_socket("127.0.0.1", 0)
        accepted = asyncio.get_running_loop().create_future()

        class Record(asyncio.Protocol):
            def connection_made(self, transport):
                s = transport.get_extra_info("socket")
                accepted.set_result(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                transport.close()

        server = await asyncio.get_running_loop().create_server(Record, sock=sock)
        _, writer = await asyncio.open_connection(*sock.getsockname())
        nodelay = await asyncio.wait_for(accepted, 10)
        writer.close()
        server.close()
        return nodelay

    assert asyncio.run(main()) != 0


def _processes_in_session(sid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getsid(int(entry)) == sid:
                    pids.append(int(entry))
            except OSError:
                pass
    return pids


def _session_left_after(sid: int, timeout: float) -> list[int]:
    """The session's processes still running once they are all gone or timeout passed."""
    deadline = time.monotonic() + timeout
    while _processes_in_session(sid) and time.monotonic() < deadline:
        time.sleep(0.5)
    return _processes_in_session(sid)


def _kill_session(sid: int) -> None:
    for pid in _processes_in_session(sid):
        os.kill(pid, signal.SIGKILL)


def test_killing_the_main_server_ends_every_process(tmp_path):
    """SIGKILL to the main process cannot stop the others itself: the extra API server
    stops when its parent is gone, and the engine process when no frontend is left."""
    proc, url, _ = _start_two_api_servers(tmp_path, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_until_healthy(url, proc)
        assert len(_processes_in_session(proc.pid)) >= 3  # main, API server, engine
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        assert _session_left_after(proc.pid, 60) == []
    finally:
        _kill_session(proc.pid)


def test_an_engine_that_fails_to_start_ends_every_process(tmp_path):
    """The extra API server starts while the engine loads; when the engine cannot start,
    the server says why once and no process is left."""
    proc, _, _ = _start_two_api_servers(tmp_path, "--num-kv-blocks", "1",
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 1
        assert out.count("minivllm serve: The KV cache holds") == 1, out
        assert "Traceback" not in out, out
        assert _session_left_after(proc.pid, 30) == []
    finally:
        _kill_session(proc.pid)


def test_api_servers_default_to_one_off_the_gpu(monkeypatch):
    from minivllm.server import launch

    assert launch.default_api_servers("cpu") == 1
    monkeypatch.setattr(launch, "MIN_CPUS_FOR_TWO_API_SERVERS", 1)
    assert launch.default_api_servers("cpu") == 1  # the engine is the limit there, not HTTP


def test_usable_cpus_honour_a_container_quota(tmp_path):
    from minivllm.server.launch import usable_cpus

    visible = usable_cpus(str(tmp_path / "absent"))
    assert visible >= 1
    (tmp_path / "cpu.max").write_text("150000 100000\n")  # 1.5 CPUs' worth of time
    assert usable_cpus(str(tmp_path / "cpu.max")) == min(visible, 2)
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert usable_cpus(str(tmp_path / "cpu.max")) == visible

