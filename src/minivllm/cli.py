"""Command line: minivllm serve | generate | chat | inspect | tokenize | bench |
download-default-model."""

from __future__ import annotations

import argparse
import sys


def _add_sampling_arguments(p: argparse.ArgumentParser) -> None:
    # Unset flags take the model's generation_config.json defaults, else greedy.
    p.add_argument("--max-tokens", type=int, default=None,
                   help="default: the generation config's max_new_tokens, else 256")
    p.add_argument("--temperature", type=float, default=None,
                   help="default: the generation config's, else 0 (greedy)")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--sampling-seed", type=int, default=None)


def _engine_from_args(args):
    from .engine.llm_engine import LLMEngine
    from .server.launch import engine_config_from_args

    return LLMEngine(engine_config_from_args(args))


def _params_from_args(args, engine):
    from .config import resolve_model_path
    from .sampling_params import SamplingParams, generation_config_defaults

    cfg = engine.config
    defaults = generation_config_defaults(cfg.generation_config,
                                          resolve_model_path(cfg.model)[1])
    given = {"max_tokens": args.max_tokens, "temperature": args.temperature,
             "top_p": args.top_p, "top_k": args.top_k, "seed": args.sampling_seed}
    return SamplingParams(**{"max_tokens": 256, "temperature": 0.0, **defaults,
                             **{k: v for k, v in given.items() if v is not None}})


def _stream(engine, prompt, params, default_max_tokens, out=sys.stdout) -> str:
    """Run one request to the end, writing text to `out` as it arrives. Without
    --max-tokens the default is cut to the room the prompt leaves."""
    rid = engine.add_request(prompt, params, default_max_tokens=default_max_tokens)
    shown = 0
    text = ""
    try:
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.request_id != rid:
                    continue
                text = o.outputs[0].text
                out.write(text[shown:])
                out.flush()
                shown = len(text)
    except KeyboardInterrupt:
        engine.abort_request(rid)
    out.write("\n")
    return text


def cmd_generate(args) -> None:
    engine = _engine_from_args(args)
    prompt = args.prompt
    if args.chat:
        from .tokenizer import render_chat
        text = render_chat(engine.tokenizer, [{"role": "user", "content": prompt}])
        prompt = {"prompt": text, "prompt_token_ids": engine.tokenize(text, False)}
    _stream(engine, prompt, _params_from_args(args, engine), args.max_tokens is None)


def cmd_chat(args) -> None:
    from .tokenizer import render_chat

    engine = _engine_from_args(args)
    params = _params_from_args(args, engine)
    history: list[dict] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    print("Chatting with the model. Empty line or Ctrl-D to quit.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        history.append({"role": "user", "content": line})
        text = render_chat(engine.tokenizer, history)
        reply = _stream(engine, {"prompt": text,
                                 "prompt_token_ids": engine.tokenize(text, False)}, params,
                         args.max_tokens is None)
        history.append({"role": "assistant", "content": reply})


def cmd_download(args) -> None:
    from .default_model import ensure_default_model

    print(ensure_default_model())


def cmd_bench(args) -> None:
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    if not (root / "bench" / "__main__.py").exists():
        raise ValueError("the benchmark harness lives in the source checkout (bench/); run "
                         "minivllm from an editable install of the repository")
    raise SystemExit(subprocess.call([sys.executable, "-m", "bench", *args.bench_args],
                                     cwd=root))


def cmd_inspect(args) -> None:
    import json

    from .model_info import format_info, model_info
    info = model_info(args.model, args.gpu_memory, args.max_model_len, args.kv_dtype)
    print(json.dumps(info, indent=1) if args.json else format_info(info))


def cmd_tokenize(args) -> None:
    from .config import resolve_model_path
    from .tokenizer import load_tokenizer
    folder, config = resolve_model_path(args.model)
    tok = load_tokenizer(config if config.suffix == ".gguf" else folder)
    ids = tok.encode(args.text, add_special_tokens=not args.no_special_tokens)
    for i in ids:
        print(f"{i:>8}  {tok.convert_ids_to_tokens(i)!r}")
    print(f"{len(ids)} tokens")


def cmd_simulate(args) -> None:
    from .engine.simulate import load_traffic, plot, replay, simulated_engine, step_lines, summary
    requests, settings = load_traffic(args.traffic)
    blocks = args.num_kv_blocks or settings.pop("num_kv_blocks", None)
    settings.pop("num_kv_blocks", None)
    if blocks is None:
        raise ValueError("Give the KV pool: --num-kv-blocks, or num_kv_blocks in the file.")
    engine = simulated_engine(args.model, blocks, **settings)
    timeline = replay(engine, requests)
    if not args.quiet:
        print("\n".join(step_lines(timeline)))
    print(summary(timeline))
    if args.plot:
        plot(timeline, args.plot)
        print(f"plot: {args.plot}")


def _metric_values(text: str) -> dict[str, float]:
    """Prometheus text -> {name: value}, summed over the label sets (per-engine series
    left out: their totals are there too)."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#") or "minivllm:engine_" in line:
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{", 1)[0]
        try:
            values[name] = values.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return values


def cmd_stats(args) -> None:
    import time
    import urllib.request

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    last = None
    printed = 0
    try:
        while not args.count or printed < args.count:
            req = urllib.request.Request(args.url.rstrip("/") + "/metrics", headers=headers)
            with urllib.request.urlopen(req, timeout=10) as r:
                m = _metric_values(r.read().decode())
            now = time.monotonic()
            gen = m.get("minivllm:generation_tokens_total", 0.0)
            rate = "" if last is None else f"  {(gen - last[1]) / (now - last[0]):,.0f} tok/s"
            done = sum(v for k, v in m.items() if k == "minivllm:request_success_total")
            print(f"running {m.get('minivllm:num_requests_running', 0):.0f}  waiting "
                  f"{m.get('minivllm:num_requests_waiting', 0):.0f}  KV "
                  f"{100 * m.get('minivllm:kv_cache_usage_perc', 0):.1f}%  finished "
                  f"{done:.0f}  generated {gen:,.0f}{rate}", flush=True)
            printed += 1
            last = (now, gen)
            if not args.count or printed < args.count:
                time.sleep(args.interval)
    except KeyboardInterrupt:
        pass


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="minivllm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    from .server.launch import add_engine_arguments  # imports nothing heavy

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    try:
        from .server.launch import add_serve_arguments
        add_serve_arguments(serve)
    except ImportError as e:  # the server's web dependencies are optional on GPU boxes
        serve.set_defaults(serve_import_error=e)

    gen = sub.add_parser("generate", help="generate from one prompt, streaming to stdout")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    add_engine_arguments(gen)
    _add_sampling_arguments(gen)

    chat = sub.add_parser("chat", help="interactive chat in the terminal")
    chat.add_argument("--system", default=None)
    add_engine_arguments(chat)
    _add_sampling_arguments(chat)

    ins = sub.add_parser("inspect", help="a model's shape, weight and KV-cache bytes, and "
                                         "what fits in a given memory (from its config)")
    ins.add_argument("model", nargs="?", default=None,
                     help="folder, config.json or .gguf (default: the default model)")
    ins.add_argument("--gpu-memory", type=float, default=None, metavar="GB",
                     help="how many KV tokens and full-length sequences fit beside the "
                          "weights in this much memory")
    ins.add_argument("--max-model-len", type=int, default=None)
    ins.add_argument("--kv-dtype", default="bf16", choices=["bf16", "fp16", "fp8", "fp32"])
    ins.add_argument("--json", action="store_true", help="print JSON")

    tok = sub.add_parser("tokenize", help="a text's tokens and ids under a model's tokenizer")
    tok.add_argument("model", help="a folder or .gguf with a tokenizer")
    tok.add_argument("text")
    tok.add_argument("--no-special-tokens", action="store_true",
                     help="without the tokenizer's added special tokens (BOS, ...)")

    sim = sub.add_parser("simulate", help="replay a traffic file through the scheduler, "
                                          "without the model (examples/traffic.json)")
    sim.add_argument("traffic")
    sim.add_argument("--model", default=None,
                     help="folder or config.json whose shapes count (default: the default "
                          "model); never loaded")
    sim.add_argument("--num-kv-blocks", type=int, default=None,
                     help="the KV pool (default: the traffic file's num_kv_blocks)")
    sim.add_argument("--plot", default=None, metavar="PNG", help="write the timeline here")
    sim.add_argument("--quiet", action="store_true", help="the summary only")

    st = sub.add_parser("stats", help="a running server's live numbers (its /metrics), "
                                      "refreshed in the terminal")
    st.add_argument("--url", default="http://127.0.0.1:8000")
    st.add_argument("--interval", type=float, default=1.0, help="seconds between lines")
    st.add_argument("--count", type=int, default=0, help="lines to print (0: until Ctrl-C)")
    st.add_argument("--api-key", default=None)

    sub.add_parser("download-default-model",
                   help="prepare SmolLM2-135M-Instruct in the local cache (once)")

    bench = sub.add_parser("bench", help="the benchmark harness (python -m bench) of a "
                                         "source checkout; `minivllm bench` lists its commands")
    bench.add_argument("bench_args", nargs=argparse.REMAINDER)

    args = parser.parse_args(argv)
    try:
        _dispatch(parser, args)
    except ValueError as e:  # bad model path, parameters or prompt: a message, no traceback
        parser.exit(2, f"minivllm: error: {e}\n")


def _dispatch(parser: argparse.ArgumentParser, args) -> None:
    if args.command == "serve":
        if getattr(args, "serve_import_error", None):
            parser.error(f"the server needs fastapi and uvicorn: {args.serve_import_error}")
        from .server.launch import run_server
        run_server(args)
        return
    commands = {"generate": cmd_generate, "chat": cmd_chat, "inspect": cmd_inspect,
                "tokenize": cmd_tokenize, "simulate": cmd_simulate, "stats": cmd_stats,
                "download-default-model": cmd_download, "bench": cmd_bench}
    commands[args.command](args)


if __name__ == "__main__":
    main()
