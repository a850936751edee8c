"""`minivllm serve`: command-line flags and the server's start-up.

cli.py calls add_serve_arguments(parser) and run_server(args). This module imports
nothing heavy at import time (no torch, fastapi or uvicorn), so the CLI's other commands
work where the server's dependencies are missing. `python -m minivllm.server` runs it
directly.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import os
import signal
import sys
import threading
from pathlib import Path

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_MAX_WAITING_REQUESTS = 1024
# Two HTTP processes need a core each beside the engine's and the tokenizers' work.
MIN_CPUS_FOR_TWO_API_SERVERS = 8


def add_engine_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The engine's flags (vLLM's names), shared by `minivllm serve`, `generate` and
    `chat`; engine_config_from_args reads them."""
    parser.add_argument("--model", default=None,
                        help="A Hugging Face model folder, a config.json (with --load-format "
                             "dummy) or a .gguf file. Default: SmolLM2-135M-Instruct, "
                             "prepared on first use.")
    parser.add_argument("--tokenizer", default=None, help="Tokenizer folder (default: the "
                                                          "model's).")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="Context length (default: the model's).")
    parser.add_argument("--max-num-seqs", type=int, default=256,
                        help="Most sequences in one batch (default 256).")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="Token budget of one step (default: max(8192, max-num-seqs)).")
    parser.add_argument("--block-size", type=int, default=None,
                        help="Tokens per KV-cache block (default: 64 on a GPU, 16 on a CPU).")
    parser.add_argument("--num-kv-blocks", type=int, default=None,
                        help="Fix the number of KV-cache blocks (default: from memory).")
    parser.add_argument("--dtype", default="auto",
                        help="auto, float32, float16 or bfloat16 (auto: fp32 on a CPU).")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                        help="Share of GPU memory for weights, activations and KV cache.")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="No CUDA graphs.")
    parser.add_argument("--max-graph-tokens", type=int, default=None,
                        help="Prefill and mixed steps of up to this many tokens replay CUDA "
                             "graphs (default: the step budget, at most 8192; 0: none).")
    parser.add_argument("--load-format", default="auto",
                        choices=["auto", "safetensors", "gguf", "dummy"],
                        help="dummy: random weights from config.json alone.")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                        default=True, help="Reuse KV blocks of shared prompt prefixes.")
    parser.add_argument("--seed", type=int, default=0, help="Engine seed.")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N.")
    parser.add_argument("--skip-tokenizer-init", action="store_true",
                        help="No tokenizer: prompts must be token ids (no chat).")
    parser.add_argument("--generation-config", default="auto", metavar="auto|vllm|FOLDER",
                        help="Sampling defaults for the fields a request leaves unset "
                             "(temperature, top_p, top_k, min_p, repetition_penalty, and "
                             "max_new_tokens as max_tokens): 'auto' (default) reads the model "
                             "folder's generation_config.json, 'vllm' ignores it (OpenAI's "
                             "defaults), a FOLDER reads its generation_config.json.")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                        help="Split the model over this many processes (tensor parallelism: "
                             "one per GPU over NCCL, or over gloo on the CPU).")
    parser.add_argument("--nnodes", type=int, default=1,
                        help="Hosts the tensor-parallel ranks are split over (evenly).")
    parser.add_argument("--node-rank", type=int, default=0,
                        help="This host's place among them: 0 runs the engine and the API "
                             "server, the others only their ranks' workers.")
    parser.add_argument("--master-addr", default="127.0.0.1",
                        help="Node 0's address, where the ranks meet.")
    parser.add_argument("--master-port", type=int, default=None,
                        help="Node 0's port for the ranks to meet (needed with --nnodes).")
    parser.add_argument("--quantization", "-q", default=None,
                        choices=["fp8", "int8", "int4", "gptq", "awq", "compressed-tensors"],
                        help="Quantize the decoder's projections at load: fp8 (FP8 weights; "
                             "W8A8 on FP8 tensor cores in large steps), int8 or int4 "
                             "(weight-only; int4 in groups of 128). gptq / awq / "
                             "compressed-tensors: the checkpoint is quantized so (found from "
                             "its config.json when left out). The CPU runs each through a "
                             "reference path (dequantize, then matmul).")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"],
                        help="The KV cache's element type: auto (the model's dtype) or fp8 "
                             "(e4m3 with a scale of 1, half the bytes of bf16: twice the "
                             "tokens).")
    compat = parser.add_argument_group(
        "vLLM flags accepted so that its command lines run (no effect here)")
    compat.add_argument("--trust-remote-code", action="store_true",
                        help="minivllm runs its own model classes, never code from the "
                             "model folder.")
    compat.add_argument("--disable-log-stats", action="store_true",
                        help="minivllm logs no periodic stats (see /metrics).")
    compat.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                        default=None, help="Prefills are always chunked.")
    compat.add_argument("--swap-space", type=float, default=None,
                        help="Preempted sequences are recomputed, not swapped.")
    compat.add_argument("--max-seq-len-to-capture", type=int, default=None,
                        help="The graphs cover every length.")
    compat.add_argument("--tokenizer-mode", default="auto", choices=["auto", "hf"],
                        help="The folder's Hugging Face tokenizer.")
    compat.add_argument("--revision", default=None, help="Models are local folders.")
    compat.add_argument("--download-dir", default=None, help="Models are local folders.")
    compat.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1, choices=[1],
                        help="No pipeline parallelism: 1 only.")
    compat.add_argument("--distributed-executor-backend", default=None,
                        help="Ranks are processes started by the engine.")
    compat.add_argument("--disable-custom-all-reduce", action="store_true",
                        help="The all-reduces are NCCL's.")
    parser.add_argument("--max-logprobs", type=int, default=20,
                        help="The most logprobs a request may ask for (default 20; -1: the "
                             "whole vocabulary). Chat's top_logprobs stays at most 20, as "
                             "OpenAI's.")
    parser.add_argument("--speculative-config", type=_json_object, default=None,
                        metavar="JSON",
                        help='Speculative decoding, as vLLM\'s: e.g. \'{"method": "ngram", '
                             '"num_speculative_tokens": 4, "prompt_lookup_max": 5}\' or '
                             '\'{"method": "draft_model", "model": PATH, '
                             '"num_speculative_tokens": 4}\'.')
    return parser


def add_serve_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags of `minivllm serve`: the engine's and the server's own."""
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="Model folder, config.json or .gguf (same as --model).")
    add_engine_arguments(parser)
    parser.add_argument("--host", default=DEFAULT_HOST, help="Address to listen on "
                                                             f"(default {DEFAULT_HOST}).")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT,
                        help=f"Port (default {DEFAULT_PORT}).")
    parser.add_argument("--served-model-name", nargs="+", default=None,
                        help="Name(s) the API answers to; the first is reported. Default: "
                             "the model folder's name.")
    parser.add_argument("--api-key", default=None,
                        help="Require 'Authorization: Bearer KEY' (except on /health, /ping, "
                             "/version, /metrics and the docs).")
    for flag, what in (("--allowed-origins", "origins"), ("--allowed-methods", "methods"),
                       ("--allowed-headers", "headers")):
        parser.add_argument(flag, type=json.loads, default=["*"], metavar="JSON",
                            help=f"The {what} a browser page may call the API with, a JSON "
                                 f"list (default [\"*\"]: any).")
    parser.add_argument("--allow-credentials", action="store_true",
                        help="Let cross-origin requests carry credentials (cookies, auth).")
    parser.add_argument("--chat-template", type=chat_template_arg, default=None,
                        metavar="FILE|TEMPLATE",
                        help="The Jinja chat template to render chats with, a file or the "
                             "template itself (default: the tokenizer's).")
    parser.add_argument("--chat-template-content-format", default="auto",
                        choices=["auto", "string"],
                        help="Messages reach the template with their content as a string "
                             "(text parts one per line).")
    parser.add_argument("--root-path", default="",
                        help="The path prefix a proxy serves the API under.")
    parser.add_argument("--ssl-keyfile", default=None, help="Serve HTTPS with this key...")
    parser.add_argument("--ssl-certfile", default=None, help="...and this certificate.")
    parser.add_argument("--uvicorn-log-level", default=None,
                        choices=["critical", "error", "warning", "info", "debug", "trace"],
                        help="uvicorn's log level (default: --log-level).")
    parser.add_argument("--tool-call-parser", default="auto",
                        choices=["auto", "hermes", "llama3_json", "mistral"],
                        help="The format of the model's tool calls: auto (default) reads it "
                             "from the chat template (hermes when the template shows none).")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help="Accepted for vLLM's command lines: tool_choice 'auto' is "
                             "always on.")
    parser.add_argument("--reasoning-parser", default=None, choices=["deepseek_r1", "qwen3"],
                        help="Report <think>...</think> apart from the answer "
                             "(reasoning_content); grammars and tool calls then constrain "
                             "only what follows it.")
    parser.add_argument("--max-waiting-requests", type=int,
                        default=DEFAULT_MAX_WAITING_REQUESTS,
                        help="Requests accepted but not yet started before the server "
                             "answers 503 (0: no limit; default "
                             f"{DEFAULT_MAX_WAITING_REQUESTS}).")
    parser.add_argument("--shutdown-timeout", type=float, default=10.0,
                        help="On shutdown, seconds to let in-flight requests finish before "
                             "they are aborted (default 10).")
    parser.add_argument("--log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug"],
                        help="Server log level.")
    parser.add_argument("--disable-log-requests", action="store_true",
                        help="Don't log each HTTP request.")
    parser.add_argument("--api-servers", type=int, default=None,
                        help="HTTP server processes sharing the port and the one engine "
                             "(vLLM's --api-server-count). Default: 2 on a GPU with at "
                             f"least {MIN_CPUS_FOR_TWO_API_SERVERS} CPUs to run on, else 1 "
                             "(one process cannot stream a GPU engine's tokens one at a "
                             "time at high concurrency). --max-waiting-requests is then "
                             "per process; /metrics counts every process's requests.")
    parser.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                        help="Engines serving the same model, each in a process of its own: "
                             "one per GPU where the host has as many and --device names none, "
                             "else sharing the device's memory. A request goes to the engine "
                             "with the fewest in flight, or to the one that served its "
                             "prompt's first tokens (each API server process routes its "
                             "own requests).")
    parser.add_argument("--engine-in-thread", action="store_true",
                        help="Run the engine on a thread of the server's process instead of "
                             "a process of its own (they then share the GIL: slower under "
                             "load).")
    return parser


def default_api_servers(device: str) -> int:
    """2 when the engine runs on a GPU and the host has the cores, else 1. On the H200 at
    256 concurrent streams (Qwen2.5-0.5B) one process fell behind its engine: tokens came
    7 to 12 a chunk, with a p99 gap of 91-106 ms; two streamed 1.7-1.8 a chunk, p99 15-17
    ms, at as many tokens a second, and level at c=1 to 64 (docs/decisions.md). On a CPU
    the engine is the limit."""
    from ..config import resolve_device

    if resolve_device(device).type != "cuda":
        return 1
    return 2 if usable_cpus() >= MIN_CPUS_FOR_TWO_API_SERVERS else 1


def usable_cpus(cpu_max: str = "/sys/fs/cgroup/cpu.max") -> int:
    """The CPUs this process may run on, capped by its cgroup's CPU quota (a container's
    CPU limit, which the affinity mask does not show)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cpus = cpus or 1
    try:
        with open(cpu_max) as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            cpus = min(cpus, max(1, -(-int(quota) // int(period))))
    except (OSError, ValueError):
        pass  # no cgroup v2 CPU controller here: no quota
    return cpus


def chat_template_arg(value: str) -> str:
    """--chat-template: a file's text, or the template given inline (as vLLM takes it)."""
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text()
    if "{{" in value or "{%" in value:
        return value
    raise argparse.ArgumentTypeError(f"{value!r} is neither a file nor a Jinja template.")


def engine_config_from_args(args: argparse.Namespace):
    from ..config import EngineConfig

    model = args.model or getattr(args, "model_tag", None)
    return EngineConfig(
        model=model, tokenizer=args.tokenizer, dtype=args.dtype,
        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
        gpu_memory_utilization=args.gpu_memory_utilization, num_kv_blocks=args.num_kv_blocks,
        enforce_eager=args.enforce_eager, max_graph_tokens=args.max_graph_tokens,
        load_format=args.load_format, seed=args.seed,
        device=args.device, skip_tokenizer_init=args.skip_tokenizer_init,
        enable_prefix_caching=args.enable_prefix_caching,
        generation_config=args.generation_config,
        speculative_config=args.speculative_config, quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype, tensor_parallel_size=args.tensor_parallel_size,
        nnodes=args.nnodes, node_rank=args.node_rank, master_addr=args.master_addr,
        master_port=args.master_port, max_logprobs=args.max_logprobs)


# The cyclic GC's thresholds in an HTTP frontend process (Python's: 700, 10, 10). With 256
# streams in flight each holds ~190 tracked objects (coroutines of the ASGI stack, cells,
# outputs), which young collections keep promoting: a full collection of ~50k objects
# (~25 ms on the CPU VM) came every ~130 requests, and GC took ~500 us per request. Fewer,
# larger young collections let most of a request's objects die before they are promoted
# (bench.frontend_micro, docs/decisions.md).
FRONTEND_GC_THRESHOLDS = (5000, 50, 10)


def prepare_frontend_gc() -> None:
    """Once the server is built: freeze what is alive (see freeze_startup_objects), then
    the frontend's GC thresholds."""
    import gc

    from ..engine.llm_engine import freeze_startup_objects

    freeze_startup_objects()
    gc.set_threshold(*FRONTEND_GC_THRESHOLDS)


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def new_engine(args: argparse.Namespace, start: bool = True, extra_frontends: int = 0):
    """The server's AsyncLLMEngine; with start=False not yet launched. extra_frontends:
    the other API server processes that will attach to it."""
    from ..engine.async_llm_engine import AsyncLLMEngine

    if getattr(args, "data_parallel_size", 1) > 1:
        from ..engine.data_parallel import DataParallelEngine
        return DataParallelEngine(engine_config_from_args(args), args.data_parallel_size,
                                  max_waiting_requests=args.max_waiting_requests or None,
                                  start=start, extra_frontends=extra_frontends)
    # The engine gets a process of its own: sharing the GIL with the HTTP event loop cost
    # ~3x throughput at 64 concurrent streams (docs/decisions.md).
    return AsyncLLMEngine(engine_config_from_args(args),
                          max_waiting_requests=args.max_waiting_requests or None,
                          engine_process=not args.engine_in_thread,
                          extra_frontends=extra_frontends, start=start)


def build_server(args: argparse.Namespace, engine=None, metrics_store=None,
                 metrics_row: int = 0):
    """(uvicorn.Server, AsyncLLMEngine): the engine started, the server not yet. With
    `engine` (started, or an attached frontend), only the server is built around it.
    metrics_store / metrics_row: see api_server.build_app."""
    from .api_server import build_app, make_server

    if engine is None:
        engine = new_engine(args)
    try:
        app = build_app(engine, served_model_names=args.served_model_name,
                        api_key=args.api_key, max_num_seqs=args.max_num_seqs,
                        drain_timeout=args.shutdown_timeout,
                        metrics_store=metrics_store, metrics_row=metrics_row,
                        generation_config=args.generation_config,
                        tool_call_parser=args.tool_call_parser,
                        reasoning_parser=args.reasoning_parser,
                        chat_template=args.chat_template, root_path=args.root_path,
                        cors=dict(allow_origins=args.allowed_origins,
                                  allow_methods=args.allowed_methods,
                                  allow_headers=args.allowed_headers,
                                  allow_credentials=args.allow_credentials))
    except BaseException:  # e.g. a malformed generation_config.json: don't leave it running
        engine.stop()
        raise
    server = make_server(app, host=args.host, port=args.port,
                         log_level=args.uvicorn_log_level or args.log_level,
                         access_log=not args.disable_log_requests, timeout_keep_alive=30,
                         ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile)
    return server, engine


def _listening_socket(host: str, port: int):
    """One socket for every API server process (each accepts from it)."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP named: asyncio sets TCP_NODELAY only on sockets whose proto says TCP, and
    # without it each stream's first chunk waited ~40 ms for the client's delayed ACK.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _api_server_process(args: argparse.Namespace, connection, sock, ready, metrics_store,
                        metrics_row: int) -> None:
    """Main of an extra API server process: a frontend attached to the engine process.
    Sets `ready` (an Event) once it is about to serve."""
    from ..engine.async_llm_engine import AsyncLLMEngine
    from ..engine.data_parallel import DataParallelEngine
    from ..thread_names import set_os_thread_name

    set_os_thread_name(multiprocessing.current_process().name)  # minivllm-api-N
    logging.basicConfig(level=getattr(logging, args.log_level.upper(), logging.INFO),
                        format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    # One connection, or under data parallelism one per engine.
    frontend = DataParallelEngine if isinstance(connection, list) else AsyncLLMEngine
    try:
        engine = frontend.attach(connection,
                                 max_waiting_requests=args.max_waiting_requests or None)
    except BaseException:  # noqa: BLE001 - the engine did not start: the main process says why
        return
    server, _ = build_server(args, engine, metrics_store, metrics_row)
    prepare_frontend_gc()
    threading.Thread(target=_stop_with_parent, name="parent-watch", daemon=True).start()
    ready.set()
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    finally:
        engine.stop()


def _stop_with_parent() -> None:
    """In an extra API server process: a graceful stop once the main server process is
    gone (killed outright, it cannot stop this one; the engine process then ends too,
    with no frontend left)."""
    multiprocessing.parent_process().join()
    os.kill(os.getpid(), signal.SIGTERM)


def run_worker_node_from_args(args: argparse.Namespace) -> None:
    """`minivllm serve --node-rank K` (K > 0): this node's tensor-parallel workers."""
    from ..config import attention_backend, resolve_device, resolve_dtype
    from ..engine.llm_engine import read_model_config
    from ..worker.tensor_parallel import run_worker_node

    cfg = engine_config_from_args(args)
    model_path, _, model_cfg = read_model_config(cfg.model)
    device = resolve_device(cfg.device)
    cfg.finalize(model_cfg, device)
    dtype = resolve_dtype(cfg.dtype, model_cfg.checkpoint_dtype, device)
    logging.getLogger("minivllm.server").info(
        "Node %d of %d: tensor-parallel workers, meeting at %s:%s.", args.node_rank,
        args.nnodes, args.master_addr, args.master_port)
    run_worker_node(cfg, model_cfg, model_path, dtype, attention_backend(device))


def run_server(args: argparse.Namespace) -> None:
    """Build the engine, then serve until SIGINT/SIGTERM; shut down gracefully."""
    logging.basicConfig(level=getattr(logging, args.log_level.upper(), logging.INFO),
                        format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    log = logging.getLogger("minivllm.server")
    if args.node_rank > 0:  # a worker node: no engine, no HTTP server
        run_worker_node_from_args(args)
        return
    if args.data_parallel_size > 1 and args.engine_in_thread:
        sys.exit("minivllm serve: --data-parallel-size runs its engines in processes of "
                 "their own")
    if args.api_servers is None:
        args.api_servers = 1 if args.engine_in_thread else default_api_servers(args.device)
    if args.api_servers < 1:
        sys.exit("minivllm serve: --api-servers must be at least 1")
    if args.api_servers > 1 and args.engine_in_thread:
        sys.exit("minivllm serve: --api-servers needs the engine in its own process")
    engine, sockets, workers, readiness, metrics_store = None, None, [], [], None
    try:
        if args.api_servers > 1:
            # The other API processes start (Python, torch, the server's imports) while the
            # engine process loads the model, not after it (they then took 7.7 s of a 37 s
            # start on the H200).
            from .metrics import shared_metrics_store

            sockets = [_listening_socket(args.host, args.port)]
            metrics_store = shared_metrics_store(args.api_servers)
            engine = new_engine(args, start=False,
                                extra_frontends=args.api_servers - 1).launch()
            workers, readiness = _start_api_servers(args, engine, sockets[0], metrics_store)
            engine.start()
        server, engine = build_server(args, engine, metrics_store)
    except BaseException as e:
        if engine is not None:
            engine.stop()
        _stop_api_servers(workers, 0.0)
        if isinstance(e, ImportError):
            sys.exit(f"minivllm serve needs the server dependencies (fastapi, uvicorn, "
                     f"pydantic, orjson): {e}")
        from ..engine.async_llm_engine import EngineDeadError
        # An engine that died while starting has logged why (its own traceback).
        if isinstance(e, (ValueError, FileNotFoundError, OSError, EngineDeadError)):
            sys.exit(f"minivllm serve: {e}")
        raise
    prepare_frontend_gc()  # the server process's own objects, then its GC thresholds
    names = server.config.app.state.serving.served_model_names
    log.info("Serving %s (max_model_len %d) on http://%s:%d", names[0], engine.max_model_len,
             args.host, args.port)
    # Serve (and answer /health) only once every process can: while one was still
    # starting, the first request took 1.4 s on the 2-core CPU VM (10 ms after).
    for w, ready in zip(workers, readiness):
        while not ready.wait(0.5):
            if not w.is_alive():
                engine.stop()
                _stop_api_servers(workers, 0.0)
                sys.exit(f"minivllm serve: API server process {w.name} failed to start")
    if workers:
        log.info("%d API server processes share the port.", args.api_servers)
    try:
        server.run(sockets=sockets)
    except KeyboardInterrupt:
        # uvicorn re-raises the SIGINT it caught once its graceful shutdown is done.
        pass
    finally:
        engine.stop()
        _stop_api_servers(workers, args.shutdown_timeout)


def _start_api_servers(args: argparse.Namespace, engine, sock,
                       metrics_store) -> tuple[list, list]:
    """(processes, their ready Events): one extra API server process per engine frontend
    connection, each accepting from `sock`, process k writing row k of `metrics_store`
    (the main process row 0)."""
    ctx = multiprocessing.get_context("spawn")
    workers, readiness = [], []
    for k, conn in enumerate(engine.frontend_connections):
        readiness.append(ctx.Event())
        workers.append(ctx.Process(target=_api_server_process, name=f"minivllm-api-{k + 1}",
                                   args=(args, conn, sock, readiness[-1], metrics_store,
                                         k + 1)))
        workers[-1].start()
        for c in conn if isinstance(conn, list) else [conn]:
            c.close()  # the worker holds it now; the engine must see EOF if it dies
    return workers, readiness


def _stop_api_servers(workers: list, drain_timeout: float) -> None:
    """Wait for the extra API server processes. Ctrl-C reached them too; a SIGTERM sent to
    this process alone did not, so one still running after a second gets one (a graceful
    shutdown for uvicorn), then, past the drain time, a second (forced)."""
    for w in workers:
        w.join(1.0)
        if w.is_alive():
            os.kill(w.pid, signal.SIGTERM)
    for w in workers:
        w.join(drain_timeout + 10)
        if w.is_alive():
            w.terminate()
            w.join(5)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="minivllm serve",
                                     description="OpenAI-compatible minivllm server.")
    add_serve_arguments(parser)
    run_server(parser.parse_args(argv))
