"""The dashboard's page and data endpoints on a real server (the page's script itself is
checked for syntax by node where it is installed; its behaviour in a browser is not
tested here yet)."""

from __future__ import annotations

import shutil
import subprocess
import threading
import time

import httpx
import pytest

from minivllm.server.dashboard import PAGE_DIR
from minivllm.server.testing import ServerThread


@pytest.fixture(scope="module")
def server(tiny_text_model_dir):
    with ServerThread(dict(model=str(tiny_text_model_dir), max_model_len=256),
                      api_key="secret") as s:
        yield s


def test_the_page_is_open_and_its_data_behind_the_key(server):
    page = httpx.get(server.url + "/dashboard")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    for tab in ("Playground", "Tokenizer", "Engine", "Benchmarks"):
        assert tab in page.text
    script = httpx.get(server.url + "/dashboard/app.js")
    assert script.status_code == 200 and "javascript" in script.headers["content-type"]
    assert httpx.get(server.url + "/dashboard/api/engine").status_code == 401


def test_engine_numbers_move_while_requests_run(server):
    auth = {"Authorization": "Bearer secret"}
    before = httpx.get(server.url + "/dashboard/api/engine", headers=auth).json()
    assert before["running"] is True and before["num_blocks"] > 0

    def load():
        httpx.post(server.url + "/v1/completions", headers=auth, timeout=60, json={
            "prompt": "Hello", "max_tokens": 120, "ignore_eos": True, "n": 2})
    worker = threading.Thread(target=load)
    worker.start()
    seen_running = 0
    while worker.is_alive():
        now = httpx.get(server.url + "/dashboard/api/engine", headers=auth).json()
        seen_running = max(seen_running, now["num_requests_running"])
        time.sleep(0.02)
    after = httpx.get(server.url + "/dashboard/api/engine", headers=auth).json()
    assert seen_running == 1 and after["generation_tokens"] - before["generation_tokens"] == 240
    steps = httpx.get(server.url + "/dashboard/api/steps", headers=auth).json()
    assert steps["fields"] == ["time", "path", "tokens", "sequences", "seconds"]
    decodes = [s for s in steps["steps"] if s[3] == 2 and s[2] == 2]  # the two samples
    assert len(decodes) > 50 and all(s[4] >= 0 for s in decodes)


def test_benchmarks_list_the_committed_results(server):
    r = httpx.get(server.url + "/dashboard/api/benchmarks",
                  headers={"Authorization": "Bearer secret"}).json()
    assert r["rows"] and {"date", "machine", "what", "json files"} <= set(r["rows"][0])


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed")
def test_the_script_parses():
    proc = subprocess.run(["node", "--check", str(PAGE_DIR / "app.js")], capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr


def test_streams_report_their_timings_when_asked(server):
    """return_metrics (minivllm's extension, the playground's queue wait): the final
    usage chunk carries the queue wait and the time to first token; without it, nothing."""
    import json
    auth = {"Authorization": "Bearer secret"}
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
                       ("/v1/completions", {"prompt": "Hi"})):
        for ask in (True, False):
            r = httpx.post(server.url + path, headers=auth, timeout=60, json={
                **body, "max_tokens": 4, "stream": True, "return_metrics": ask,
                "stream_options": {"include_usage": True}})
            chunks = [json.loads(line[6:]) for line in r.text.splitlines()
                      if line.startswith("data: {")]
            final = chunks[-1]
            assert final["usage"]["completion_tokens"] == 4
            if ask:
                m = final["metrics"]
                assert 0 <= m["queue_s"] <= m["ttft_s"] < 60
            else:
                assert "metrics" not in final
