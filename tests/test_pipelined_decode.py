"""Pipelined greedy decoding (step N+1 launched before step N's tokens are read) gives
exactly the output of plain step-by-step decoding, whatever stops, aborts or preemptions
happen in between. Run here through the decode-graph runner in eager mode on the CPU."""

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.engine.llm_engine import PLACEHOLDER_TOKEN
from minivllm.worker.cuda_graph_runner import DecodeGraphRunner
from conftest import random_prompts


def _llm(model_dir, monkeypatch, pipelined: bool, **kw):
    monkeypatch.setenv("MINIVLLM_PIPELINE", "1" if pipelined else "0")
    kw.setdefault("skip_tokenizer_init", True)
    kw.setdefault("max_model_len", 128)
    llm = LLM(str(model_dir), block_size=4, max_num_seqs=8, **kw)
    runner, cfg = llm.engine.runner, llm.engine.config
    runner.graph_runner = DecodeGraphRunner(
        runner.model, runner.kv_cache.layers, max_batch=cfg.max_num_seqs,
        max_blocks=cfg.max_blocks_per_seq(), block_size=cfg.block_size,
        max_model_len=cfg.max_model_len, device=torch.device("cpu"),
        use_compile=False, use_graphs=False)
    launches = []
    orig = runner.launch_decode
    runner.launch_decode = lambda batch, prev: launches.append(prev is not None) or orig(batch, prev)
    return llm, launches


def test_pipelined_equals_step_by_step(tiny_model_dirs, monkeypatch):
    prompts = random_prompts(6, 256, 3, 30, seed=21)
    free = _llm(tiny_model_dirs["llama"], monkeypatch, False)[0].generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=25, ignore_eos=True),
        use_tqdm=False)
    # Stop on tokens that really occur, at different steps per prompt.
    stop_ids = [o.outputs[0].token_ids[3 + i] for i, o in enumerate(free)]
    params = [SamplingParams(temperature=0.0, max_tokens=5 + 3 * i, ignore_eos=True,
                             stop_token_ids=[stop_ids[i]] if i % 2 else None)
              for i in range(4)]
    # Seeded random sampling takes part too: its generator draws once per step either way.
    params += [SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=20,
                              ignore_eos=True),
               SamplingParams(temperature=1.2, top_k=5, min_p=0.05, seed=12, max_tokens=17,
                              stop_token_ids=[stop_ids[5]])]
    plain, _ = _llm(tiny_model_dirs["llama"], monkeypatch, False)
    want = plain.generate(prompts, params, use_tqdm=False)
    piped, launches = _llm(tiny_model_dirs["llama"], monkeypatch, True)
    got = piped.generate(prompts, params, use_tqdm=False)
    for w, g in zip(want, got):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].finish_reason == w.outputs[0].finish_reason
        assert PLACEHOLDER_TOKEN not in g.outputs[0].token_ids
    assert sum(launches) > 10  # most decode steps were launched ahead
    assert piped.engine.scheduler.pool.all_free()


def test_pipelined_with_preemption_and_mixed_params(tiny_model_dirs, monkeypatch):
    prompts = random_prompts(6, 256, 8, 20, seed=22)
    params = [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)] * 4 + [
        SamplingParams(temperature=0.8, seed=3, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=30, logprobs=2, ignore_eos=True)]
    want = _llm(tiny_model_dirs["qwen2"], monkeypatch, False)[0].generate(
        prompts, params, use_tqdm=False)
    tight, launches = _llm(tiny_model_dirs["qwen2"], monkeypatch, True, num_kv_blocks=40)
    got = tight.generate(prompts, params, use_tqdm=False)
    assert tight.engine.scheduler.num_preemptions > 0
    assert [g.outputs[0].token_ids for g in got] == [w.outputs[0].token_ids for w in want]
    assert launches  # greedy-only stretches were launched without waiting
    assert tight.engine.scheduler.pool.all_free()


def test_abort_while_a_step_is_pending(tiny_model_dirs, monkeypatch):
    llm, launches = _llm(tiny_model_dirs["qwen3"], monkeypatch, True)
    eng = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for i, p in enumerate(random_prompts(3, 256, 5, 12, seed=23)):
        eng.add_request(p, params, request_id=f"r{i}")
    for _ in range(6):
        eng.step()
    assert eng._pending is not None
    assert eng.abort_request("r1")
    outs = []
    while eng.has_unfinished_requests():
        outs.extend(eng.step())
    assert {o.request_id for o in outs if o.finished} == {"r0", "r2"}
    for o in outs:
        assert PLACEHOLDER_TOKEN not in o.outputs[0].token_ids
    eng.step()
    assert eng._pending is None and eng.scheduler.pool.all_free()


def test_pipelined_streaming_text_and_stop_strings(tiny_text_model_dir, monkeypatch):
    prompt = "The weather today is"
    base, _ = _llm(tiny_text_model_dir, monkeypatch, False, skip_tokenizer_init=False)
    free = base.generate(prompt, SamplingParams(temperature=0.0, max_tokens=30,
                         ignore_eos=True), use_tqdm=False)[0].outputs[0].text
    stop = free[12:17]
    params = SamplingParams(temperature=0.0, max_tokens=30, stop=[stop], ignore_eos=True)
    piped, launches = _llm(tiny_text_model_dir, monkeypatch, True, skip_tokenizer_init=False)
    eng = piped.engine
    eng.add_request(prompt, params, request_id="s")
    seen = []
    while eng.has_unfinished_requests():
        seen.extend(o.outputs[0].text for o in eng.step())
    assert seen[-1] == free[:free.index(stop)]
    for a, b in zip(seen, seen[1:]):
        assert b.startswith(a)
    assert any(launches)
