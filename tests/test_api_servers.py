"""`minivllm serve --api-servers 2`: two HTTP server processes share the port and one engine
process; requests through either give the same tokens; a SIGINT to the main process alone
still stops every process and frees the port."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys

import httpx
import openai

from minivllm.server.testing import make_tiny_chat_model, wait_until_healthy


def test_two_api_servers_share_one_engine(tmp_path):
    model = make_tiny_chat_model(tmp_path / "tiny-chat")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "minivllm.server", "--model", str(model), "--port", str(port),
         "--max-model-len", "512", "--num-kv-blocks", "256", "--api-servers", "2",
         "--log-level", "warning", "--shutdown-timeout", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
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
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
        with socket.socket() as sock:  # every process has let go of the port
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", port))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
