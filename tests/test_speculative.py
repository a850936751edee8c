"""Speculative decoding by n-gram lookup: greedy output identical to the target alone, under
batching, preemption, prefix caching, stops and max_tokens; the block pool whole after."""

from __future__ import annotations

import random
import subprocess
import sys

import httpx
import openai
import pytest

from minivllm import LLM, SamplingParams
from minivllm.config import EngineConfig
from minivllm.engine.speculative import SpeculativeConfig, accepted_count, ngram_proposal
from minivllm.server.testing import ServerThread

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
         "prompt_lookup_max": 4}


def repetitive_prompts(n: int, seed: int) -> list[list[int]]:
    """Prompts that repeat a phrase (lookup finds continuations) and one random prompt."""
    rng = random.Random(seed)
    out = []
    for i in range(n - 1):
        phrase = [rng.randrange(3, 250) for _ in range(6 + i)]
        out.append(phrase * 3 + phrase[:2])
    out.append([rng.randrange(3, 250) for _ in range(25)])
    return out


def ids(outputs) -> list[list[int]]:
    return [c.token_ids for o in outputs for c in o.outputs]


@pytest.mark.parametrize("cfg, message", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "method must be one of"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
      "prompt_lookup_max": 2}, "larger than"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "unknown keys"),
    ({"method": "draft_model", "model": "x", "num_speculative_tokens": 2}, "not supported"),
    ("ngram", "must be a dict"),
])
def test_invalid_configs_are_rejected(cfg, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(speculative_config=cfg)


def test_config_defaults_and_proposals():
    cfg = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3})
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (2, 5)
    assert SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3,
                                        "prompt_lookup_max": 1}).prompt_lookup_min == 1
    # The latest earlier occurrence of the longest matching suffix wins.
    assert ngram_proposal([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3], 2, 2, 3) == [7, 8]
    assert ngram_proposal([5, 1, 2, 6, 4, 1, 2], 3, 2, 4) == [6, 4, 1]
    assert ngram_proposal([1, 2, 3, 4], 2, 2, 4) == []       # no repeat
    assert ngram_proposal([4, 4], 3, 1, 2) == [4]            # n=1, the run continues
    assert accepted_count([3, 4, 5], [3, 4, 9, 1]) == 2
    assert accepted_count([3], [3, 8]) == 1 and accepted_count([2], [3, 8]) == 0


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_greedy_output_is_unchanged(tiny_model_dirs, family):
    prompts = repetitive_prompts(4, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    kw = dict(skip_tokenizer_init=True, max_model_len=192, block_size=4)
    want = LLM(str(tiny_model_dirs[family]), **kw).generate(prompts, params, use_tqdm=False)
    llm = LLM(str(tiny_model_dirs[family]), speculative_config=NGRAM, **kw)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert ids(got) == ids(want)
    stats = llm.engine.stats
    assert stats["spec_decode_num_accepted_tokens"] > 0  # it did speculate and accept
    assert stats["spec_decode_num_accepted_tokens"] <= stats["spec_decode_num_draft_tokens"]
    assert stats["generation_tokens"] == 4 * 30
    assert llm.engine.scheduler.pool.all_free()


def test_mixed_batches_preemption_prefix_cache_and_max_tokens(tiny_model_dirs):
    """Greedy and sampled requests in one batch (only greedy ones speculate), a KV cache
    small enough to preempt, shared prefixes, and max_tokens from 1 up: outputs as without
    speculation, never longer than max_tokens."""
    prompts = repetitive_prompts(6, seed=5) * 2  # the repeats hit the prefix cache
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
              for m in (1, 2, 5, 17, 33, 40)]
    params += [SamplingParams(temperature=0.8, seed=i, max_tokens=20, ignore_eos=True)
               for i in range(3)]
    params += [SamplingParams(temperature=0.0, max_tokens=25, ignore_eos=True, n=2)] * 3
    kw = dict(skip_tokenizer_init=True, max_model_len=128, block_size=4, num_kv_blocks=60,
              max_num_seqs=8)
    want = LLM(str(tiny_model_dirs["qwen2"]), **kw).generate(prompts, params, use_tqdm=False)
    llm = LLM(str(tiny_model_dirs["qwen2"]), speculative_config=NGRAM, **kw)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert ids(got) == ids(want)
    for o, p in zip(got, params):
        assert all(len(c.token_ids) == p.max_tokens for c in o.outputs)
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.scheduler.pool.cache_hits > 0
    assert llm.engine.stats["spec_decode_num_accepted_tokens"] > 0
    assert llm.engine.scheduler.pool.all_free()


def test_stop_token_inside_accepted_drafts(tiny_model_dirs):
    """A stop token id among a step's accepted tokens ends the output there."""
    prompt = repetitive_prompts(2, seed=7)[0]
    kw = dict(skip_tokenizer_init=True, max_model_len=128, block_size=4)
    plain = LLM(str(tiny_model_dirs["llama"]), **kw)
    free_run = plain.generate([prompt], SamplingParams(temperature=0.0, max_tokens=30,
                                                       ignore_eos=True), use_tqdm=False)
    stop = free_run[0].outputs[0].token_ids[12]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True,
                            stop_token_ids=[stop])
    want = plain.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    llm = LLM(str(tiny_model_dirs["llama"]), speculative_config=NGRAM, **kw)
    got = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == want.token_ids and got.token_ids[-1] == stop
    assert got.finish_reason == want.finish_reason == "stop"
    assert llm.engine.scheduler.pool.all_free()


@pytest.mark.slow
def test_real_model_chat_with_stop_string_and_server(default_model_dir):
    """SmolLM2-135M: a prompt that quotes text to repeat gives the same greedy answer with
    and without n-gram speculation, most drafts accepted; a stop string ends both alike;
    the server takes --speculative-config and reports spec_decode_* in /metrics."""
    text = ("The quick brown fox jumps over the lazy dog near the quiet river bank, "
            "while the old farmer watches from the wooden porch of his red house.")
    question = [{"role": "user", "content": f"Repeat this sentence exactly: {text}"}]
    params = SamplingParams(temperature=0.0, max_tokens=48)
    stop = SamplingParams(temperature=0.0, max_tokens=48, stop=["river"])
    kw = dict(max_model_len=512, max_num_seqs=4)
    plain = LLM(str(default_model_dir), **kw)
    spec = LLM(str(default_model_dir), speculative_config=NGRAM, **kw)
    for p in (params, stop):
        a = plain.chat(question, p, use_tqdm=False)[0].outputs[0]
        b = spec.chat(question, p, use_tqdm=False)[0].outputs[0]
        assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason)
    s = spec.engine.stats
    assert s["spec_decode_num_accepted_tokens"] > s["spec_decode_num_draft_tokens"] / 2

    with ServerThread(dict(model=str(default_model_dir), speculative_config=NGRAM, **kw)) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0,
                               timeout=120)
        out = client.chat.completions.create(model=client.models.list().data[0].id,
                                             messages=question, max_tokens=48, temperature=0.0)
        a = plain.chat(question, params, use_tqdm=False)[0].outputs[0].text
        assert out.choices[0].message.content == a
        metrics = httpx.get(srv.url + "/metrics").text
        assert "minivllm:spec_decode_num_accepted_tokens_total" in metrics


def test_serve_rejects_a_bad_speculative_config():
    proc = subprocess.run([sys.executable, "-m", "minivllm.cli", "serve", "--speculative-config",
                           "[1, 2]"], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "must be a JSON object" in proc.stderr
