"""Helpers for tests and benchmarks: a tiny random chat model that uses the real SmolLM2
tokenizer, and a real uvicorn server running in a background thread on a free port."""

from __future__ import annotations

import shutil
import socket
import threading
import time
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "chat_template.jinja")


def make_tiny_chat_model(dest: str | Path, tokenizer_dir: str | Path | None = None, *,
                         seed: int = 0, max_position_embeddings: int = 4096) -> Path:
    """Write a tiny random LlamaForCausalLM (vocab 49152, hidden 64, 2 layers, 4 heads,
    2 KV heads) with the tokenizer files of `tokenizer_dir` (default: the default model's,
    prepared if needed) into `dest`. Weights are spread so greedy choices are clear-cut."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if tokenizer_dir is None:
        from ..default_model import ensure_default_model
        tokenizer_dir = ensure_default_model(verbose=False)
    dest, tokenizer_dir = Path(dest), Path(tokenizer_dir)
    dest.mkdir(parents=True, exist_ok=True)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=max_position_embeddings, bos_token_id=1,
                      eos_token_id=2, pad_token_id=2, tie_word_embeddings=False,
                      rms_norm_eps=1e-5)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.08)
    model.save_pretrained(dest, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, dest / name)
    return dest


class ServerThread:
    """A real minivllm server (AsyncLLMEngine + FastAPI app + uvicorn) on 127.0.0.1 on a
    free port, served from a background thread. Use as a context manager, or start()
    and stop(). `engine_kwargs` go to EngineConfig; `app_kwargs` to build_app;
    engine_process=True runs the engine in a process of its own, as `minivllm serve`;
    data_parallel_size=N runs N such engines (engine/data_parallel.py)."""

    def __init__(self, engine_kwargs: dict, *, max_waiting_requests: int | None = None,
                 log_level: str = "warning", engine_process: bool = False,
                 data_parallel_size: int = 1, **app_kwargs) -> None:
        self.engine_kwargs = engine_kwargs
        self.engine_process = engine_process
        self.data_parallel_size = data_parallel_size
        self.max_waiting_requests = max_waiting_requests
        self.app_kwargs = app_kwargs
        self.log_level = log_level
        self.engine = None
        self.app = None
        self.server = None
        self._thread: threading.Thread | None = None
        self._sock: socket.socket | None = None
        self.url = ""

    def start(self, timeout: float = 120.0) -> "ServerThread":
        from ..config import EngineConfig
        from ..engine.async_llm_engine import AsyncLLMEngine
        from .api_server import build_app, make_server

        if self.data_parallel_size > 1:
            from ..engine.data_parallel import DataParallelEngine
            self.engine = DataParallelEngine(EngineConfig(**self.engine_kwargs),
                                             self.data_parallel_size,
                                             max_waiting_requests=self.max_waiting_requests)
        else:
            self.engine = AsyncLLMEngine(EngineConfig(**self.engine_kwargs),
                                         max_waiting_requests=self.max_waiting_requests,
                                         engine_process=self.engine_process)
        try:
            self.app = build_app(self.engine, **self.app_kwargs)
        except BaseException:
            self.engine.stop()
            raise
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.server = make_server(self.app, host="127.0.0.1", port=port,
                                  log_level=self.log_level, access_log=False)
        self._thread = threading.Thread(target=self.server.run,
                                        kwargs={"sockets": [self._sock]},
                                        name="minivllm-test-server", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        if self.server is not None:
            self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
        if self.engine is not None:
            self.engine.stop()
        if self._sock is not None:
            self._sock.close()

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def wait_until_healthy(url: str, proc=None, timeout: float = 90.0) -> None:
    """Poll GET url/health until it answers 200; fail early if `proc` (a server started as
    a subprocess) exits meanwhile, with its output when that was piped."""
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        if proc is not None and proc.poll() is not None:
            output = proc.stdout.read() if proc.stdout is not None else b""
            if isinstance(output, bytes):
                output = output.decode(errors="replace")
            raise RuntimeError(f"the server exited ({proc.returncode}): {output[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError("the server did not start in time")
        time.sleep(0.2)
