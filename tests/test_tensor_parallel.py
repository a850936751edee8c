"""Tensor parallelism on the CPU (gloo): the model split over 2 or 3 processes gives the
greedy tokens of one process and logprobs within fp32 rounding, through batching, chunked
prefill and preemption; shapes it cannot split are refused with the reason."""

from __future__ import annotations

import pytest

from minivllm import LLM, SamplingParams
from conftest import random_prompts

PROMPTS = random_prompts(5, 256, 3, 40, seed=2)


def _run(model_dir, world: int, **kw):
    llm = LLM(str(model_dir), skip_tokenizer_init=True, max_model_len=128,
              tensor_parallel_size=world, **kw)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=3)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert llm.engine.scheduler.pool.all_free()
    return outs


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_tp2_matches_one_process(tiny_model_dirs, family):
    """qwen2's single KV head is replicated on both ranks; llama's two are split."""
    want = _run(tiny_model_dirs[family], 1)
    for kw in (dict(), dict(block_size=4, max_num_batched_tokens=16, max_num_seqs=4,
                            num_kv_blocks=32)):
        got = _run(tiny_model_dirs[family], 2, **kw)
        for w, g in zip(want, got):
            assert g.outputs[0].token_ids == w.outputs[0].token_ids
            for lw, lg in zip(w.outputs[0].logprobs, g.outputs[0].logprobs):
                for token, entry in lw.items():
                    assert abs(lg[token].logprob - entry.logprob) < 1e-4


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_vocabulary_the_ranks_do_not_divide(tmp_path, family):
    """The embedding and the head split by vocabulary: 253 ids over 2 ranks, the last
    slice padded (llama's head its own tensor, qwen2's tied to the embedding); the same
    tokens and logprobs as one process, every id embedded and scored."""
    from transformers import AutoConfig, AutoModelForCausalLM
    import torch
    from conftest import TINY_CONFIGS

    cfg = dict(TINY_CONFIGS[family], vocab_size=253)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"),
                                                                   **cfg))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.08)
    model.save_pretrained(tmp_path, safe_serialization=True)
    prompts = random_prompts(4, 253, 3, 30, seed=5)
    prompts[0][:3] = [252, 0, 127]  # the ids at both ends of the slices
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)
    want, got = (LLM(str(tmp_path), skip_tokenizer_init=True, max_model_len=64,
                     tensor_parallel_size=w).generate(prompts, params, use_tqdm=False)
                 for w in (1, 2))
    for w, g in zip(want, got):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for lw, lg in zip(w.outputs[0].logprobs, g.outputs[0].logprobs):
            assert lw.keys() == lg.keys()
            for token, entry in lw.items():
                assert abs(lg[token].logprob - entry.logprob) < 1e-4


@pytest.mark.slow
def test_tp3_on_the_real_model(default_model_dir):
    """SmolLM2-135M: 9 heads, 3 KV heads, MLP width 1536 split three ways; 2 does not
    divide its heads: refused, with the reason."""
    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = SamplingParams(temperature=0.0, max_tokens=12)
    one = LLM(str(default_model_dir), max_model_len=256).generate(prompts, params)
    three = LLM(str(default_model_dir), max_model_len=256,
                tensor_parallel_size=3).generate(prompts, params)
    assert [o.outputs[0].text for o in three] == [o.outputs[0].text for o in one]
    with pytest.raises(ValueError, match="must divide the attention heads"):
        LLM(str(default_model_dir), max_model_len=256, tensor_parallel_size=2)


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_quantization_under_tp(tiny_model_dirs, method):
    """Quantized at load, each rank its shard (a row-parallel projection's scales from its
    own columns): close to one process's quantized model."""
    want = _run(tiny_model_dirs["llama"], 1, quantization=method)
    got = _run(tiny_model_dirs["llama"], 2, quantization=method)
    # The tiny random model's top tokens are often within a few hundredths: compare the
    # first step's distributions, not whole outputs (they part at the first near-tie).
    firsts = 0
    for w, g in zip(want, got):
        lw, lg = w.outputs[0].logprobs[0], g.outputs[0].logprobs[0]
        firsts += w.outputs[0].token_ids[0] == g.outputs[0].token_ids[0]
        for token, entry in lw.items():
            if token in lg:
                assert abs(entry.logprob - lg[token].logprob) < 0.1
    assert firsts >= 3


@pytest.mark.parametrize("fmt", ["gptq", "awq", "compressed-tensors", "fp8-tensor",
                                 "compressed-tensors-channel"])
def test_checkpoints_quantized_ahead_split_exactly(tmp_path, fmt):
    """A checkpoint quantized ahead (4-bit GPTQ, AWQ, compressed-tensors; FP8 by tensor or
    channel) is split as it stands: each rank holds the checkpoint's own numbers for its
    rows or its groups of inputs, so two ranks give one process's tokens and logprobs."""
    from minivllm.model.quantization import QuantizedLinear
    from test_prequantized import write_checkpoints, write_fp8_checkpoints
    fp8 = fmt.endswith(("tensor", "channel"))
    qdir = (write_fp8_checkpoints(fmt, tmp_path, family="llama") if fp8
            else write_checkpoints("llama", fmt, tmp_path))[0]
    # FP8 on steps of one token, which keep their activations: a longer step rounds them
    # to FP8 with a scale per token, which each rank takes over its own part of the row.
    kw = dict(max_num_batched_tokens=1, max_num_seqs=1) if fp8 else {}
    want = _run(qdir, 1, **kw)
    llm = LLM(str(qdir), skip_tokenizer_init=True, max_model_len=128, tensor_parallel_size=2,
              **kw)
    down = llm.engine.runner.model.inner.model.layers[0].mlp.down_proj.linear
    assert isinstance(down, QuantizedLinear) and down.in_features == 64
    got = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True,
                                               logprobs=3), use_tqdm=False)
    for w, g in zip(want, got):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for lw, lg in zip(w.outputs[0].logprobs, g.outputs[0].logprobs):
            for token, entry in lw.items():
                assert abs(lg[token].logprob - entry.logprob) < 1e-4
    assert llm.engine.scheduler.pool.all_free()


def test_act_order_checkpoints_are_refused_under_tp(tmp_path):
    from test_prequantized import write_checkpoints
    qdir = write_checkpoints("llama", "gptq", tmp_path, act_order=True)[0]
    with pytest.raises(ValueError, match="act-order"):
        LLM(str(qdir), skip_tokenizer_init=True, max_model_len=128, tensor_parallel_size=2)


def test_two_nodes(tiny_model_dirs):
    """A "two-node" launch on this machine: node 1 is `minivllm serve --node-rank 1` (its
    rank's worker only), node 0 the engine; they meet at master_port. The output is one
    process's, and node 1 ends when the engine stops."""
    import gc
    import subprocess
    import sys

    from minivllm.worker.tensor_parallel import free_port
    model = str(tiny_model_dirs["llama"])
    port = free_port()
    node1 = subprocess.Popen(
        [sys.executable, "-m", "minivllm.cli", "serve", "--model", model,
         "--skip-tokenizer-init", "--max-model-len", "128", "--tensor-parallel-size", "2",
         "--nnodes", "2", "--node-rank", "1", "--master-port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        want = _run(model, 1)
        llm = LLM(model, skip_tokenizer_init=True, max_model_len=128, tensor_parallel_size=2,
                  nnodes=2, master_port=port)
        params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=3)
        got = llm.generate(PROMPTS, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
        del llm, got
        gc.collect()
        assert node1.wait(timeout=30) == 0
    finally:
        if node1.poll() is None:
            node1.kill()


def test_speculative_decoding_under_tp(tiny_model_dirs):
    """n-gram and draft-model speculation verify their drafts through the split model
    (the draft model runs unsplit in the engine's process): one process's tokens."""
    from test_speculative import repetitive_prompts
    prompts = repetitive_prompts(3, seed=11)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    kw = dict(skip_tokenizer_init=True, max_model_len=128)
    model = str(tiny_model_dirs["llama"])
    want = LLM(model, **kw).generate(prompts, params, use_tqdm=False)
    for spec in ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
                  "prompt_lookup_max": 4},
                 {"method": "draft_model", "model": model, "num_speculative_tokens": 2}):
        llm = LLM(model, tensor_parallel_size=2, speculative_config=spec, **kw)
        got = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


def test_graphed_steps_run_on_every_rank(tiny_model_dirs):
    """The steps a GPU replays as CUDA graphs, run eagerly here by their runners on both
    ranks: each step's inputs reach the worker through the runner's own broadcasts (the
    ones a graph captures), after rank 0 names the step. Decode buckets, mixed-step
    buckets and the mixed runner's unpadded long steps, pipelined, with greedy and seeded
    rows and logprobs: one process's tokens, and the pool whole."""
    from collections import Counter

    prompts = random_prompts(6, 256, 3, 60, seed=7)
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True)] * 3
    kw = dict(skip_tokenizer_init=True, max_model_len=128, max_num_seqs=4, block_size=4,
              max_num_batched_tokens=64, max_graph_tokens=16)
    model = str(tiny_model_dirs["llama"])
    want = LLM(model, **kw).generate(prompts, params, use_tqdm=False)
    llm = LLM(model, tensor_parallel_size=2, **kw)
    runner = llm.engine.runner
    runner.setup_step_runners()
    steps = Counter()
    for name, obj, method in (("decode", runner.graph_runner, "replay"),
                              ("mixed", runner.mixed_runner, "replay"),
                              ("long", runner.mixed_runner, "eager_step")):
        def counted(*args, _name=name, _run=getattr(obj, method)):
            steps[_name] += 1
            return _run(*args)
        setattr(obj, method, counted)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert steps["decode"] and steps["mixed"] and steps["long"], steps
    for w, g in zip(want, got):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for lw, lg in zip(w.outputs[0].logprobs or [], g.outputs[0].logprobs or []):
            for token, entry in lw.items():
                assert abs(lg[token].logprob - entry.logprob) < 1e-4
    assert llm.engine.scheduler.pool.all_free()


def test_step_inputs_travel_to_each_ranks_device():
    """What rank 0 broadcasts each forward (token ids, positions, AttentionMetadata with
    host lists) comes back equal, its tensors on the device asked for."""
    import torch

    from minivllm.model.attention import AttentionMetadata
    from minivllm.worker.tensor_parallel import moved

    meta = AttentionMetadata(
        slot_mapping=torch.arange(5), query_start_loc=torch.tensor([0, 2, 5], dtype=torch.int32),
        seq_lens=torch.tensor([7, 3], dtype=torch.int32),
        block_tables=torch.zeros(2, 4, dtype=torch.int32), max_query_len=3, max_seq_len=7,
        query_start_loc_host=[0, 2, 5], seq_lens_host=[7, 3])
    step = (torch.tensor([4, 5, 6, 7, 8]), torch.arange(5), meta)
    back = moved(step, torch.device("cpu"))
    assert isinstance(back, tuple) and isinstance(back[2], AttentionMetadata)
    assert torch.equal(back[0], step[0]) and back[2].seq_lens_host == [7, 3]
    assert torch.equal(back[2].block_tables, meta.block_tables)
    assert back[2].max_query_len == 3 and back[2].decode_counters is None


def test_each_rank_gets_a_gpu_of_its_node():
    import torch

    from minivllm.config import EngineConfig
    from minivllm.worker.tensor_parallel import rank_device

    cfg = EngineConfig(device="cuda", tensor_parallel_size=4, nnodes=2)
    assert [rank_device(cfg, r) for r in range(4)] == [torch.device("cuda", i)
                                                       for i in (0, 1, 0, 1)]
    cfg = EngineConfig(device="cuda:2", tensor_parallel_size=2)
    assert [rank_device(cfg, r).index for r in range(2)] == [2, 3]
    assert rank_device(EngineConfig(device="cpu", tensor_parallel_size=2), 1).type == "cpu"


@pytest.mark.parametrize("family,load_format", [("llama", "auto"), ("qwen2", "dummy"),
                                                ("llama", "gptq")])
def test_layers_load_one_at_a_time(tiny_model_dirs, tmp_path, monkeypatch, family,
                                   load_format):
    """A rank never holds the whole model: each decoder layer is allocated when its first
    weight arrives and handed over (to be cut to the shard) before the next is allocated
    (a checkpoint quantized ahead too: its tensors' names come from the checkpoint); the
    loaded weights are those of the plain load."""
    import torch
    from minivllm.config import ModelConfig, load_config_json
    from minivllm.model import loader
    from test_prequantized import write_checkpoints

    model_dir = tiny_model_dirs[family]
    if load_format == "gptq":
        model_dir, load_format = write_checkpoints(family, "gptq", tmp_path)[0], "auto"
    cfg = ModelConfig.from_dict(load_config_json(model_dir / "config.json"))
    events = []
    materialize = loader._materialize

    def recording(module, *args, **kw):
        if "skip" not in kw:
            events.append(("allocated", module))
        materialize(module, *args, **kw)

    monkeypatch.setattr(loader, "_materialize", recording)
    kw = dict(load_format=load_format, dtype=torch.float32, device=torch.device("cpu"),
              max_positions=128, attention_backend="torch")
    model = loader.load_model(cfg, model_dir, **kw,
                              layer_loaded=lambda layer: events.append(("loaded", layer)))
    layers = list(model.model.layers)
    assert events == [(step, layer) for layer in layers for step in ("allocated", "loaded")]
    plain = loader.load_model(cfg, model_dir, **kw).state_dict()
    got = model.state_dict()
    assert got.keys() == plain.keys()
    for name, value in plain.items():
        assert torch.equal(got[name], value), name
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    assert tied == cfg.tie_word_embeddings


def test_workers_start_from_an_engine_process_and_from_replicas(tiny_model_dirs):
    """Tensor-parallel workers start from the server's engine process and from each engine
    of LLM(data_parallel_size=2) (neither can be a daemon process, which may not have
    children): both give one process's greedy tokens. Then the server's worker is killed:
    the engine is reported dead (/health 503), not left serving errors."""
    import os
    import signal
    from pathlib import Path

    import httpx

    from minivllm.server.testing import ServerThread
    model = str(tiny_model_dirs["llama"])
    kw = dict(skip_tokenizer_init=True, max_model_len=64)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    want = [o.outputs[0].token_ids
            for o in LLM(model, **kw).generate(PROMPTS, params, use_tqdm=False)]
    with ServerThread(dict(model=model, tensor_parallel_size=2, **kw),
                      engine_process=True) as server:
        for prompt, tokens in zip(PROMPTS[:2], want):
            r = httpx.post(server.url + "/v1/completions", timeout=60, json=dict(
                model=model, prompt=prompt, max_tokens=6, temperature=0, ignore_eos=True,
                return_token_ids=True))
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["token_ids"] == tokens
        pid = server.engine._process.pid
        for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
            os.kill(int(child), signal.SIGKILL)  # the worker
        r = httpx.post(server.url + "/v1/completions", timeout=60, json=dict(
            model=model, prompt=PROMPTS[0], max_tokens=4))
        assert r.status_code >= 500
        assert httpx.get(server.url + "/health", timeout=10).status_code == 503
    llm = LLM(model, data_parallel_size=2, tensor_parallel_size=2, **kw)
    got = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == want


def test_a_dead_worker_ends_the_engine(tiny_model_dirs):
    """A worker that dies fails the step that needed it, and every later one at once with
    the reason (the ranks may be out of step: no step waits for them forever); through
    the server: test_workers_start_from_an_engine_process_and_from_replicas."""
    model = str(tiny_model_dirs["llama"])
    kw = dict(skip_tokenizer_init=True, max_model_len=64)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm = LLM(model, tensor_parallel_size=2, **kw)
    llm.engine.runner.tp.procs[0].kill()
    llm.engine.runner.tp.procs[0].join()
    with pytest.raises(RuntimeError):
        llm.generate(PROMPTS[:2], params, use_tqdm=False)
    with pytest.raises(RuntimeError, match="out of step"):
        llm.generate(PROMPTS[:2], params, use_tqdm=False)


def test_a_worker_that_dies_while_starting_is_an_error(tiny_model_dirs, tmp_path):
    """A worker that dies before joining the group (here: its import of the script fails,
    as a script without a main guard's would) is an error at once, not a 10-minute wait."""
    import subprocess
    import sys
    script = tmp_path / "start.py"
    script.write_text(
        "import sys\n"
        "if __name__ == '__mp_main__':\n"
        "    raise SystemExit(3)  # the worker's import of this script\n"
        "from minivllm import LLM\n"
        "LLM(sys.argv[1], skip_tokenizer_init=True, max_model_len=64, tensor_parallel_size=2)\n")
    done = subprocess.run([sys.executable, str(script), str(tiny_model_dirs["llama"])],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert "minivllm-tp1 exited (code 3) before joining the group" in done.stderr
