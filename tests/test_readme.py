"""Every command in README.md's code blocks runs, as a user would type it: `make` targets
exist (CI runs `make test` itself), `minivllm serve` starts a real server on a free port,
the curl and the openai client examples ask it, the offline example and the terminal
commands run on the default model. Only the port is changed."""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"```(bash|python)\n(.*?)```", README, flags=re.S)
BIN = Path(sys.executable).parent


def commands() -> list[list[str]]:
    """The bash blocks' commands as argv lists (continuations joined, comments dropped)."""
    out = []
    for lang, body in BLOCKS:
        if lang == "bash":
            for line in body.replace("\\\n", " ").splitlines():
                argv = shlex.split(line, comments=True)
                if argv:
                    out.append(argv)
    return out


def python_blocks() -> list[str]:
    return [body for lang, body in BLOCKS if lang == "python"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def with_port(text: str, port: int) -> str:
    return text.replace("127.0.0.1:8000", f"127.0.0.1:{port}")


def run(argv: list[str], **kwargs) -> subprocess.CompletedProcess:
    env = dict(os.environ, PATH=f"{BIN}:{os.environ['PATH']}")
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300, **kwargs)


def test_the_readme_shows_each_kind_of_command():
    kinds = {(argv[0], argv[1]) if argv[0] == "minivllm" else argv[0] for argv in commands()}
    assert {"make", "curl", ("minivllm", "serve"), ("minivllm", "generate")} <= kinds
    assert len(python_blocks()) >= 2
    for argv in commands():
        assert argv[0] in {"make", "curl", "minivllm"}, f"no test runs {argv}"


def test_make_targets_exist():
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), flags=re.M))
    for argv in commands():
        if argv[0] == "make":
            assert argv[1] in targets, argv
            # A dry run: the target and its variables parse (nothing is executed).
            assert run(["make", "-n", *argv[1:]]).returncode == 0, argv


@pytest.fixture(scope="module")
def server(default_model_dir):
    """The README's `minivllm serve` command, on a free port."""
    [argv] = [a for a in commands() if a[:2] == ["minivllm", "serve"]]
    port = free_port()
    env = dict(os.environ, PATH=f"{BIN}:{os.environ['PATH']}")
    proc = subprocess.Popen([*argv, "--port", str(port)], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, proc.stderr.read()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.5)
        yield port
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_curl_example(server):
    [argv] = [a for a in commands() if a[0] == "curl"]
    done = run([with_port(a, server) for a in argv])
    assert done.returncode == 0, done.stderr
    reply = json.loads(done.stdout)
    assert reply["object"] == "chat.completion"
    assert "Paris" in reply["choices"][0]["message"]["content"]


def test_openai_client_example(server):
    [code] = [b for b in python_blocks() if "OpenAI(" in b]
    done = run([sys.executable, "-c", with_port(code, server)])
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip()


def test_offline_example(default_model_dir):
    [code] = [b for b in python_blocks() if "LLM(" in b]
    done = run([sys.executable, "-c", code])
    assert done.returncode == 0, done.stderr
    completion, answer = done.stdout.strip().split("\n", 1)
    assert completion.strip() and "Paris" in answer


def test_terminal_commands(default_model_dir):
    for argv in commands():
        if argv[0] == "minivllm" and argv[1] != "serve":
            done = run(argv)
            assert done.returncode == 0, (argv, done.stderr)
            assert done.stdout.strip(), argv
