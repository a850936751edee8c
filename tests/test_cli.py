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


def test_bench_lists_the_harness_commands():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "minivllm.cli", "bench"], capture_output=True,
                          text=True, timeout=120, env=env)
    assert "report" in proc.stdout + proc.stderr
