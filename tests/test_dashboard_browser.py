"""The dashboard in a real headless browser (Debian's chromium, driven by Playwright's
Python API) against a real server with the real default model: every tab loads without a
console error, the playground streams an answer, the tokenizer's ids are /tokenize's, the
engine's numbers move while requests run. MINIVLLM_SCREENSHOTS=DIR saves each tab there
(docs/ holds the committed ones)."""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path

import httpx
import pytest

from minivllm.server.testing import ServerThread

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed")]
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run"]


@pytest.fixture(scope="module")
def server(default_model_dir):
    with ServerThread(dict(model=None, max_model_len=512, max_num_seqs=8)) as s:
        yield s


@pytest.fixture(scope="module")
def page(server):
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        pg = browser.new_page(viewport={"width": 1100, "height": 720})
        pg.errors = []
        pg.on("console", lambda m: m.type == "error" and pg.errors.append(m.text))
        pg.on("pageerror", lambda e: pg.errors.append(str(e)))
        pg.goto(server.url + "/dashboard")
        yield pg
        browser.close()


def _shot(page, name: str) -> None:
    folder = os.environ.get("MINIVLLM_SCREENSHOTS")
    if folder:
        page.screenshot(path=str(Path(folder) / f"dashboard-{name}.png"))


def test_playground_streams_an_answer(page):
    page.fill("#prompt", "What is the capital of France?")
    page.fill("#max_tokens", "12")
    page.fill("#seed", "3")
    page.check("#logprobs")
    page.click("#send")
    page.wait_for_function(
        "document.getElementById('timings').textContent.includes('first token')",
        timeout=60_000)
    assert "Paris" in page.inner_text("#answer")
    assert "queue wait" in page.inner_text("#timings")
    assert page.locator("#answer span.tok").count() > 1  # tokens with their logprobs
    _shot(page, "playground")
    assert not page.errors, page.errors


def test_tokenizer_ids_are_the_servers(page, server):
    text = "Hello, world! Tokenizers split text."
    page.click("nav button[data-tab=tokenizer]")
    page.fill("#tok_text", text)
    page.click("#tokenize")
    page.wait_for_function("document.querySelectorAll('#tok_table tr').length > 1")
    shown = page.eval_on_selector_all(
        "#tok_table tr", "rows => rows.slice(1).map(r => +r.cells[1].textContent)")
    want = httpx.post(server.url + "/tokenize", json={"prompt": text}).json()["tokens"]
    assert shown == want
    page.check("#tok_chat")  # the same text as a chat: through the chat template
    page.click("#tokenize")
    chat = httpx.post(server.url + "/tokenize", json={
        "messages": [{"role": "user", "content": text}]}).json()["tokens"]
    page.wait_for_function(f"document.querySelectorAll('#tok_table tr').length == {len(chat) + 1}")
    shown = page.eval_on_selector_all(
        "#tok_table tr", "rows => rows.slice(1).map(r => +r.cells[1].textContent)")
    assert shown == chat and len(chat) > len(want)
    page.uncheck("#tok_chat")
    page.click("#tokenize")
    page.wait_for_function(f"document.querySelectorAll('#tok_table tr').length == {len(want) + 1}")
    _shot(page, "tokenizer")
    assert not page.errors, page.errors


def test_engine_numbers_move(page, server):
    page.click("nav button[data-tab=engine]")

    def generated() -> int:
        page.wait_for_selector("b[data-key=generation_tokens]")
        return int(page.inner_text("b[data-key=generation_tokens]"))

    before = generated()
    load = threading.Thread(target=lambda: httpx.post(
        server.url + "/v1/completions", timeout=120,
        json={"prompt": "Once upon a time", "max_tokens": 64, "ignore_eos": True, "n": 4}))
    load.start()
    deadline = time.monotonic() + 60
    moved = False
    while time.monotonic() < deadline and not moved:
        time.sleep(0.5)
        moved = generated() > before
    running_seen = int(page.inner_text("b[data-key=num_requests_running]"))
    page.wait_for_function("document.querySelectorAll('#steps tr').length > 1")
    _shot(page, "engine")
    load.join()
    assert moved and running_seen <= 1
    assert not page.errors, page.errors


def test_benchmarks_tab(page):
    """The report's tables and charts (bench/results/report), then the results folders."""
    page.click("nav button[data-tab=benchmarks]")
    page.wait_for_function("document.querySelectorAll('#bench_table tr').length > 1")
    assert page.locator("#report table").count() > 3
    page.wait_for_function(
        "[...document.querySelectorAll('#report img')].some(i => i.naturalWidth > 0)")
    assert "vLLM" in page.inner_text("#report")
    _shot(page, "benchmarks")
    assert not page.errors, page.errors
