"""The command line, run as a user would: a real subprocess."""

import os
import subprocess
import sys



def _run(args, model_dir, stdin=None, timeout=120):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "minivllm.cli", *args, "--model", str(model_dir),
                           "--max-model-len", "256"],
                          input=stdin, capture_output=True, text=True, timeout=timeout, env=env)


def test_generate_streams_the_same_text_as_the_api(tiny_text_model_dir):
    from minivllm import LLM, SamplingParams

    want = LLM(str(tiny_text_model_dir), max_model_len=256).generate(
        "Hello there", SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)
    proc = _run(["generate", "Hello there", "--max-tokens", "12"], tiny_text_model_dir)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == want[0].outputs[0].text + "\n"


def test_generate_takes_the_generation_config_and_the_engine_flags(tiny_text_model_dir,
                                                                    tmp_path):
    """Like the server: unset sampling flags take generation_config.json's defaults (here
    a seeded sample of 5 tokens), a flag overrides them, and the engine flags are serve's."""
    import json
    import shutil

    from minivllm import LLM, SamplingParams

    model = tmp_path / "model"
    shutil.copytree(tiny_text_model_dir, model)
    (model / "generation_config.json").write_text(json.dumps(
        {"max_new_tokens": 5, "temperature": 0.9, "top_k": 20}))
    want = LLM(str(model), max_model_len=256).generate(
        "Hello there", SamplingParams(temperature=0.9, top_k=20, max_tokens=5, seed=7),
        use_tqdm=False)[0].outputs[0]
    proc = _run(["generate", "Hello there", "--sampling-seed", "7", "--num-kv-blocks", "64",
                 "--max-graph-tokens", "0"], model)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == want.text + "\n" and len(want.token_ids) == 5
    greedy = LLM(str(model), max_model_len=256, generation_config="vllm").generate(
        "Hello there", SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)
    proc = _run(["generate", "Hello there", "--generation-config", "vllm", "--max-tokens", "12"],
                model)
    assert proc.stdout == greedy[0].outputs[0].text + "\n"


def test_a_default_max_tokens_is_cut_to_the_room_the_prompt_leaves(tiny_text_model_dir,
                                                                   tmp_path):
    """generation_config's max_new_tokens past max_model_len is a default, not an ask: the
    offline API and the CLI cut it to the room the prompt leaves (as the server does). The
    same number given explicitly offline runs until the context is full (vLLM's offline
    rule; the server refuses it)."""
    import json
    import shutil

    from minivllm import LLM, SamplingParams

    model = tmp_path / "model"
    shutil.copytree(tiny_text_model_dir, model)
    (model / "generation_config.json").write_text(json.dumps(
        {"max_new_tokens": 1000, "temperature": 0.0}))
    llm = LLM(str(model), max_model_len=256)
    prompt = list(range(3, 243))
    out = llm.generate([prompt, prompt[:10]], use_tqdm=False)
    assert [len(o.outputs[0].token_ids) <= 256 - len(o.prompt_token_ids) for o in out] == [
        True, True]
    asked = llm.generate(prompt, SamplingParams(max_tokens=1000, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0]
    assert len(asked.token_ids) == 16 and asked.finish_reason == "length"
    assert llm.engine.scheduler.pool.all_free()
    proc = _run(["generate", "Hello there", "--num-kv-blocks", "64", "--max-graph-tokens", "0"],
                model)
    assert proc.returncode == 0, proc.stderr


def test_chat_repl_answers_and_quits(tiny_text_model_dir):
    proc = _run(["chat", "--max-tokens", "8"], tiny_text_model_dir, stdin="Hi!\nAnd again?\n\n")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("> ") >= 2
    assert len(proc.stdout.strip().splitlines()) >= 2


def test_bad_arguments_exit_with_a_message(tiny_text_model_dir):
    proc = _run(["generate", "x", "--temperature", "-1"], tiny_text_model_dir)
    assert proc.returncode == 2
    assert "minivllm: error: temperature" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_serve_takes_vllms_command_lines(tmp_path):
    """Flags of a copied `vllm serve` line parse (the no-op ones documented as such);
    --chat-template takes a file or the template itself; values minivllm cannot honour
    are refused by argparse."""
    import argparse

    import pytest

    from minivllm.server.launch import add_serve_arguments

    parser = add_serve_arguments(argparse.ArgumentParser())
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    args = parser.parse_args([
        "M", "--trust-remote-code", "--disable-log-stats", "--enable-chunked-prefill",
        "--swap-space", "4", "--max-seq-len-to-capture", "8192", "--tokenizer-mode", "auto",
        "--pipeline-parallel-size", "1", "--distributed-executor-backend", "mp",
        "--disable-custom-all-reduce", "--uvicorn-log-level", "warning", "--root-path", "/v",
        "--chat-template", str(template), "--chat-template-content-format", "string"])
    assert args.chat_template == template.read_text() and args.root_path == "/v"
    inline = parser.parse_args(["--chat-template", "{{ messages[0].content }}"])
    assert inline.chat_template == "{{ messages[0].content }}"
    for bad in (["--pipeline-parallel-size", "2"], ["--chat-template", "no-such-file"]):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)


def test_bench_lists_the_harness_commands():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "minivllm.cli", "bench"], capture_output=True,
                          text=True, timeout=120, env=env)
    assert "report" in proc.stdout + proc.stderr


def _cli(*args):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "minivllm.cli", *args], capture_output=True,
                          text=True, timeout=120, env=env)


def test_inspect_the_default_model_and_a_dummy_config(default_model_dir):
    import json
    from pathlib import Path

    proc = _cli("inspect", str(default_model_dir), "--gpu-memory", "2", "--json")
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    # SmolLM2-135M: 134.5M parameters; 30 layers x 3 KV heads x 64 x 2 (K, V) x 2 bytes.
    assert 134e6 < info["parameters"] < 135e6
    assert info["kv_bytes_per_token"] == 30 * 3 * 64 * 2 * 2
    fits = info["fits"]["bf16"]
    assert fits["kv_tokens"] == int((2e9 - info["weight_bytes"]["bf16"]) // 23040)
    config = Path(__file__).resolve().parents[1] / "bench/model_configs/mixtral-8x7b.json"
    proc = _cli("inspect", str(config))
    assert proc.returncode == 0, proc.stderr
    assert "experts: 8, top-2" in proc.stdout and "bf16 93.4" in proc.stdout
    # Every method quantizes the experts too (~90 of the 93.4 GB).
    assert "fp8 46.9" in proc.stdout and "int8 46.9" in proc.stdout and "int4 25." in proc.stdout


def test_tokenize_prints_the_tokenizers_ids(default_model_dir):
    from transformers import AutoTokenizer

    want = AutoTokenizer.from_pretrained(default_model_dir).encode("Hello, world!")
    proc = _cli("tokenize", str(default_model_dir), "Hello, world!")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert [int(line.split()[0]) for line in lines[:-1]] == want
    assert lines[-1] == f"{len(want)} tokens"


def test_simulate_reproduces_the_engines_decisions(tiny_model_dirs, tmp_path, monkeypatch):
    """`minivllm simulate examples/traffic.json` (no model) decides what the real engine
    decides on the same traffic (a tiny model, step by step): the same requests scheduled
    with the same token counts, the same admissions and preemptions; its plot is written."""
    from pathlib import Path

    from minivllm.config import EngineConfig
    from minivllm.engine.llm_engine import LLMEngine
    from minivllm.engine.simulate import load_traffic, replay, simulated_engine

    traffic = Path(__file__).resolve().parents[1] / "examples" / "traffic.json"
    requests, settings = load_traffic(traffic)
    blocks = settings.pop("num_kv_blocks")
    model = str(tiny_model_dirs["llama"])
    simulated = replay(simulated_engine(model, blocks, **settings), requests)
    monkeypatch.setenv("MINIVLLM_PIPELINE", "0")
    real = replay(LLMEngine(EngineConfig(model=model, skip_tokenizer_init=True, device="cpu",
                                         num_kv_blocks=blocks, **settings)), requests)
    assert simulated.decisions() == real.decisions()
    assert sum(len(r.preempted) for r in real.steps) > 0  # the example does preempt
    png = tmp_path / "timeline.png"
    proc = _cli("simulate", str(traffic), "--model", model, "--plot", str(png), "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert "preemptions" in proc.stdout and png.stat().st_size > 10_000


def test_stats_reads_a_running_server(tiny_text_model_dir):
    import httpx

    from minivllm.server.testing import ServerThread
    with ServerThread(dict(model=str(tiny_text_model_dir), max_model_len=256)) as s:
        httpx.post(s.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 5,
                                                    "ignore_eos": True}, timeout=60)
        proc = _cli("stats", "--url", s.url, "--count", "2", "--interval", "0.2")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 2 and "generated 5" in lines[0] and "tok/s" in lines[1]


def test_max_logprobs_flag_reaches_the_engine_config():
    import argparse

    from minivllm.server.launch import add_engine_arguments, engine_config_from_args

    parser = add_engine_arguments(argparse.ArgumentParser())
    assert engine_config_from_args(parser.parse_args([])).max_logprobs == 20
    args = parser.parse_args(["--max-logprobs", "-1"])
    assert engine_config_from_args(args).max_logprobs == -1
