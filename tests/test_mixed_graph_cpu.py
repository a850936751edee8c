"""Prefill and mixed steps through the token-bucketed graph runner (eager on the CPU):
padding tokens and padding sequences change nothing."""

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.worker.mixed_graph_runner import MixedGraphRunner, mixed_buckets
from conftest import random_prompts


def test_mixed_buckets():
    assert mixed_buckets(512) == [16, 32, 64, 128, 256, 512]
    assert mixed_buckets(100) == [16, 32, 64, 100]
    assert mixed_buckets(8) == [8]
    # Past 1,024 tokens, steps of 512.
    assert mixed_buckets(8192) == [16, 32, 64, 128, 256, 512, 1024] + [
        512 * k for k in range(3, 17)]
    assert mixed_buckets(2300)[-3:] == [1536, 2048, 2300]


def _attach(llm, max_tokens):
    runner, cfg = llm.engine.runner, llm.engine.config
    runner.mixed_runner = MixedGraphRunner(
        runner.model, runner.kv_cache.layers, max_tokens=max_tokens, max_seqs=cfg.max_num_seqs,
        max_blocks=cfg.max_blocks_per_seq(), max_model_len=cfg.max_model_len,
        device=torch.device("cpu"), use_graphs=False)
    runner.mixed_runner.capture()
    calls = []
    orig = runner.mixed_runner.run
    runner.mixed_runner.run = lambda host, *a: calls.append(len(host.input_ids)) or orig(host, *a)
    return calls


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_mixed_steps_match_eager(tiny_model_dirs, monkeypatch, backend):
    if backend == "triton":
        pytest.importorskip("triton")
        monkeypatch.setenv("MINIVLLM_ATTENTION_BACKEND", "triton")
    # The interpreter is slow: fewer, shorter requests, and an 8-token step budget whose
    # only bucket is 8 (every step of the runner is padded to it, not to 16; the prompts of
    # 9, 8 and 3 tokens still give steps of 8, 5, 4 and 3 tokens mixing prefill chunks and
    # decode rows).
    tiny = backend == "triton"
    n = 3 if tiny else 6
    prompts = random_prompts(n, 256, 3, 12 if tiny else 40, seed=31)
    params = [SamplingParams(temperature=0.0, max_tokens=3 if tiny else 6, ignore_eos=True),
              SamplingParams(n=2, temperature=1.0, seed=4, max_tokens=3 if tiny else 5,
                             ignore_eos=True)] * 3
    params = params[:n]
    kw = dict(skip_tokenizer_init=True, max_model_len=96, block_size=4,
              max_num_seqs=4 if tiny else 8, max_num_batched_tokens=8 if tiny else 48)
    want = LLM(str(tiny_model_dirs["qwen3"]), **kw).generate(prompts, params, use_tqdm=False)
    llm = LLM(str(tiny_model_dirs["qwen3"]), **kw)
    calls = _attach(llm, 8 if tiny else 32)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert calls  # prefill/mixed steps went through the token-bucketed runner
    for w, g in zip(want, got):
        assert [c.token_ids for c in g.outputs] == [c.token_ids for c in w.outputs]
    assert llm.engine.scheduler.pool.all_free()


def test_small_buckets_project_only_their_rows(tiny_model_dirs):
    """With more sequences allowed than a bucket has tokens (24 > 16), a 16-token step's
    head projects 16 rows, not 24: the outputs are the same."""
    prompts = random_prompts(6, 256, 3, 20, seed=37)
    params = SamplingParams(n=2, temperature=1.0, seed=9, max_tokens=5, ignore_eos=True)
    kw = dict(skip_tokenizer_init=True, max_model_len=96, block_size=4, max_num_seqs=24,
              max_num_batched_tokens=48)
    want = LLM(str(tiny_model_dirs["llama"]), **kw).generate(prompts, params, use_tqdm=False)
    llm = LLM(str(tiny_model_dirs["llama"]), **kw)
    calls = _attach(llm, 32)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert 16 in [min(b for b in mixed_buckets(32) if b >= c) for c in calls]
    for w, g in zip(want, got):
        assert [c.token_ids for c in g.outputs] == [c.token_ids for c in w.outputs]


def test_long_steps_replay_only_when_padded_little(tiny_model_dirs, tmp_path):
    """Past 1,024 tokens a step replays its bucket's graph if the padding is at most a
    sixteenth of its tokens (or if start-up measured that bucket's replay to beat an eager
    step's launches: never on a CPU); otherwise it runs eagerly, unpadded. Both give the
    outputs of the engine without the runner."""
    import json
    import shutil

    # The tiny Qwen3 with a context of 2,048 (max_model_len may not exceed it).
    model = shutil.copytree(tiny_model_dirs["qwen3"], tmp_path / "qwen3-2k")
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 2048}))
    kw = dict(skip_tokenizer_init=True, max_model_len=2048, max_num_batched_tokens=2048,
              max_num_seqs=4)
    llm = LLM(str(model), **kw)
    calls = _attach(llm, 2048)
    runner = llm.engine.runner.mixed_runner
    graphed = lambda n: runner.replay_bucket(n) is not None  # noqa: E731
    assert [graphed(n) for n in (1000, 1024, 1025, 1500, 1536, 1900, 2048)] == [
        True, True, False, True, True, False, True]
    assert not runner.replay_pays  # measured on a GPU only
    runner.replay_pays.add(1536)
    assert graphed(1025) and not graphed(1900)
    runner.replay_pays.clear()
    plain = LLM(str(model), **kw)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    for length in (1500, 1100):  # one replayed (bucket 1536), one eager (it would pad 436)
        prompt = random_prompts(1, 256, length, length, seed=length)
        want = plain.generate(prompt, params, use_tqdm=False)
        got = llm.generate(prompt, params, use_tqdm=False)
        assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids
    assert calls[0] == 1500 and 1100 in calls
