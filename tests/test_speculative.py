"""Speculative decoding by n-gram lookup: greedy output identical to the target alone, under
batching, preemption, prefix caching, stops and max_tokens; sampled output the tokens the
request draws alone (a draft is kept only where it is the token drawn at its position);
logprobs of accepted tokens; the draft-length policy; the block pool whole after."""

from __future__ import annotations

import random
import subprocess
import sys

import httpx
import openai
import pytest

from minivllm import LLM, SamplingParams
from minivllm.config import EngineConfig
from minivllm.engine.speculative import (BatchGate, NgramIndex, SpeculativeConfig, StepCost,
                                         accepted_count)
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


@pytest.fixture
def drafts_always_pay(monkeypatch):
    """The draft-length policy's timing (the step-cost fit and the batch gate) put aside:
    tests of what speculation produces must not depend on how fast this machine runs it.
    The policy's own tests are below."""
    monkeypatch.setattr(StepCost, "token_share", lambda self, tokens: 0.0)
    monkeypatch.setattr(BatchGate, "open", lambda self: True)


def ngram_proposal(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """The lookup by a scan of the whole sequence: what NgramIndex must agree with."""
    for n in range(min(n_max, len(tokens) - 1), n_min - 1, -1):
        suffix = tokens[len(tokens) - n:]
        for end in range(len(tokens) - 1, n - 1, -1):
            if tokens[end - n:end] == suffix:
                return tokens[end:end + k]
    return []


def test_ngram_index_matches_a_scan():
    """Growing sequences (one token or a few at a time) of a small alphabet, so n-grams
    repeat: the index proposes what a scan of the whole sequence finds, at every length."""
    rng = random.Random(1)
    for n_min, n_max in ((1, 1), (2, 4), (3, 5)):
        tokens = [rng.randrange(4) for _ in range(3)]
        index = NgramIndex(n_min, n_max)
        while len(tokens) < 300:
            assert index.propose(tokens, 4) == ngram_proposal(tokens, 4, n_min, n_max)
            tokens += [rng.randrange(4) for _ in range(rng.choice((1, 1, 3)))]


def test_ngram_index_on_a_prefix_and_the_pipelines_filter():
    """A lookup over the first `length` tokens (those known while a step is pending)
    proposes what a scan of that prefix finds and leaves the index right for the next
    full lookup. A match of n > n_min tokens ending at the last token implies one of n - 1
    ending just before it: the filter that keeps pipelining never hides those."""
    rng = random.Random(2)
    n_min, n_max = 2, 4
    tokens = [rng.randrange(5) for _ in range(3)]
    index = NgramIndex(n_min, n_max)
    while len(tokens) < 300:
        tokens += [rng.randrange(5)]
        before = index.propose(tokens, 3, len(tokens) - 1)
        assert before == ngram_proposal(tokens[:-1], 3, n_min, n_max)
        full = index.propose(tokens, 3)
        assert full == ngram_proposal(tokens, 3, n_min, n_max)
        if ngram_proposal(tokens, 3, n_min + 1, n_max):
            assert before


def ids(outputs) -> list[list[int]]:
    return [c.token_ids for o in outputs for c in o.outputs]


@pytest.mark.parametrize("cfg, message", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "method must be one of"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
      "prompt_lookup_max": 2}, "larger than"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "unknown keys"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs 'model'"),
    ({"method": "draft_model", "model": "x", "num_speculative_tokens": 2,
      "prompt_lookup_max": 3}, "apply to method 'ngram'"),
    ({"method": "ngram", "model": "x", "num_speculative_tokens": 2}, "applies to method"),
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
def test_greedy_output_is_unchanged(tiny_model_dirs, family, drafts_always_pay):
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


def test_mixed_batches_preemption_prefix_cache_and_max_tokens(tiny_model_dirs,
                                                             drafts_always_pay):
    """Greedy and sampled requests in one batch, a KV cache small enough to preempt, shared
    prefixes, and max_tokens from 1 up: every output (sampled ones too: each position is
    drawn with its own random numbers) as without speculation, none longer than
    max_tokens."""
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


def test_stop_token_inside_accepted_drafts(tiny_model_dirs, drafts_always_pay):
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
def test_real_model_chat_with_stop_string_and_server(default_model_dir, drafts_always_pay):
    """SmolLM2-135M: a prompt that quotes text to repeat gives the same greedy answer with
    and without n-gram speculation, most drafts accepted; a stop string ends both alike;
    the server takes --speculative-config and reports spec_decode_* in /metrics."""
    text = ("The lighthouse keeper climbed the narrow stairs every evening at dusk, carrying "
            "a small brass lamp and a notebook in which he wrote the names of the ships that "
            "passed the rocky point during the night.")
    question = [{"role": "user", "content": f"Repeat the following text exactly, word for "
                                            f"word: {text}"}]
    params = SamplingParams(temperature=0.0, max_tokens=48)
    stop = SamplingParams(temperature=0.0, max_tokens=48, stop=["brass"])
    kw = dict(max_model_len=512, max_num_seqs=4)
    plain = LLM(str(default_model_dir), **kw)
    spec = LLM(str(default_model_dir), speculative_config=NGRAM, **kw)
    plain_text = {}  # the plain engine's answers, for the server below
    for name, p in (("full", params), ("stop", stop)):
        a = plain.chat(question, p, use_tqdm=False)[0].outputs[0]
        b = spec.chat(question, p, use_tqdm=False)[0].outputs[0]
        assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason)
        plain_text[name] = a.text
    s = spec.engine.stats
    assert s["spec_decode_num_accepted_tokens"] > s["spec_decode_num_draft_tokens"] / 2
    assert s["spec_decode_num_accepted_tokens"] >= 20  # the answer quotes the text

    with ServerThread(dict(model=str(default_model_dir), speculative_config=NGRAM, **kw)) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0,
                               timeout=120)
        out = client.chat.completions.create(model=client.models.list().data[0].id,
                                             messages=question, max_tokens=48, temperature=0.0)
        a = plain_text["full"]  # greedy: the same answer as above
        assert out.choices[0].message.content == a
        stream = client.chat.completions.create(model=out.model, messages=question,
                                                max_tokens=48, temperature=0.0, stream=True)
        chunks = [c.choices[0].delta.content or "" for c in stream if c.choices]
        assert "".join(chunks) == a
        assert len([c for c in chunks if c]) < len(spec.engine.tokenize(a))  # several per chunk
        metrics = httpx.get(srv.url + "/metrics").text
        assert "minivllm:spec_decode_num_accepted_tokens_total" in metrics


def test_serve_rejects_a_bad_speculative_config():
    proc = subprocess.run([sys.executable, "-m", "minivllm.cli", "serve", "--speculative-config",
                           "[1, 2]"], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "must be a JSON object" in proc.stderr


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_sampled_requests_speculate_and_draw_what_they_would_alone(tiny_model_dirs, method,
                                                                   drafts_always_pay):
    """Seeded and unseeded sampled requests (top-k, top-p, a penalty) draft, accept drafts,
    and give token for token what the engine gives without speculation; max_tokens holds
    and the pool is whole. The draft model is the target itself (its drafts at low
    temperature are accepted often: it draws them with the target's random numbers)."""
    prompts = repetitive_prompts(4, seed=11)
    params = [SamplingParams(temperature=0.3, seed=i, max_tokens=24, ignore_eos=True,
                             top_k=20, top_p=0.95, repetition_penalty=1.05 if i % 2 else 1.0)
              for i in range(3)]
    params.append(SamplingParams(temperature=0.4, max_tokens=24, ignore_eos=True))
    kw = dict(skip_tokenizer_init=True, max_model_len=160, block_size=4)
    spec = NGRAM if method == "ngram" else {
        "method": "draft_model", "model": str(tiny_model_dirs["qwen3"]),
        "num_speculative_tokens": 3}
    llm = LLM(str(tiny_model_dirs["qwen3"]), speculative_config=spec, **kw)
    together = ids(llm.generate(prompts, params, use_tqdm=False))
    assert llm.engine.stats["spec_decode_num_accepted_tokens"] > 0
    assert all(len(t) == 24 for t in together)
    plain = LLM(str(tiny_model_dirs["qwen3"]), **kw)
    assert ids(plain.generate(prompts, params, use_tqdm=False)) == together
    assert llm.engine.scheduler.pool.all_free() and plain.engine.scheduler.pool.all_free()


def test_logprobs_of_accepted_tokens(tiny_model_dirs, drafts_always_pay):
    """Greedy requests with logprobs speculate: the same tokens and logprobs (top 3, ranks)
    as without speculation."""
    prompts = repetitive_prompts(3, seed=13)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=3)
    kw = dict(skip_tokenizer_init=True, max_model_len=160, block_size=4)
    want = LLM(str(tiny_model_dirs["llama"]), **kw).generate(prompts, params, use_tqdm=False)
    llm = LLM(str(tiny_model_dirs["llama"]), speculative_config=NGRAM, **kw)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.stats["spec_decode_num_accepted_tokens"] > 0
    for g, w in zip(got, want):
        g, w = g.outputs[0], w.outputs[0]
        assert g.token_ids == w.token_ids and len(g.logprobs) == 20
        for lg, lw in zip(g.logprobs, w.logprobs):
            assert list(lg) == list(lw)
            for t in lg:
                assert lg[t].rank == lw[t].rank
                assert abs(lg[t].logprob - lw[t].logprob) < 1e-4
        assert abs(g.cumulative_logprob - w.cumulative_logprob) < 1e-3


def test_step_cost_fit():
    """The cost model recovers a + b * tokens and the share of the tokens in it."""
    cost = StepCost()
    assert cost.token_share(8) == 0.0  # nothing measured: drafts are assumed free
    for i in range(40):
        tokens = 8 + 4 * (i % 5)
        cost.observe(tokens, 0.010 + 0.001 * tokens)
    assert abs(cost.token_share(8) - 0.008 / 0.018) < 1e-6
    flat = StepCost()
    for i in range(40):
        flat.observe(8 + 4 * (i % 5), 0.010)
    assert flat.token_share(8) == 0.0


def draft_config(path, k: int = 3) -> dict:
    return {"method": "draft_model", "model": str(path), "num_speculative_tokens": k}


@pytest.mark.parametrize("draft_family", ["llama", "qwen2"])
def test_draft_model_greedy_output_is_unchanged(tiny_model_dirs, draft_family, drafts_always_pay):
    """A draft model (the target itself: every draft accepted; another tiny model: few)
    under batching, preemption, prefix caching and max_tokens: the same greedy tokens."""
    prompts = repetitive_prompts(5, seed=17) * 2
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
              for m in (1, 3, 12, 30, 41)] * 2
    kw = dict(skip_tokenizer_init=True, max_model_len=128, block_size=4, num_kv_blocks=36,
              max_num_seqs=6)
    want = LLM(str(tiny_model_dirs["llama"]), **kw).generate(prompts, params, use_tqdm=False)
    llm = LLM(str(tiny_model_dirs["llama"]),
              speculative_config=draft_config(tiny_model_dirs[draft_family]), **kw)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert ids(got) == ids(want)
    s = llm.engine.stats
    assert s["spec_decode_num_drafts"] > 0
    if draft_family == "llama":  # the draft is the target: it always agrees
        assert s["spec_decode_num_accepted_tokens"] == s["spec_decode_num_draft_tokens"]
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.scheduler.pool.all_free()


def test_draft_model_sampled_and_dummy(tiny_model_dirs, drafts_always_pay):
    """Sampled requests verified against the draft's distribution: seeded ones reproducible
    alone and in a batch; a dummy-weight draft loads with load_format='dummy'."""
    prompts = repetitive_prompts(3, seed=19)
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=16, ignore_eos=True)
              for i in range(3)]
    kw = dict(skip_tokenizer_init=True, max_model_len=128, block_size=4)
    spec = draft_config(tiny_model_dirs["qwen3"])
    llm = LLM(str(tiny_model_dirs["qwen3"]), speculative_config=spec, **kw)
    together = ids(llm.generate(prompts, params, use_tqdm=False))
    assert llm.engine.stats["spec_decode_num_accepted_tokens"] > 0
    alone = [ids(llm.generate([p], [sp], use_tqdm=False))[0] for p, sp in zip(prompts, params)]
    assert alone == together and all(len(t) == 16 for t in together)
    assert llm.engine.scheduler.pool.all_free()
    dummy = LLM(str(tiny_model_dirs["qwen3"]), speculative_config=spec, load_format="dummy",
                **kw)
    out = dummy.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    assert dummy.engine.stats["spec_decode_num_accepted_tokens"] > 0  # same dummy weights
    assert all(len(t) == 8 for t in ids(out))


def test_draft_model_with_another_vocabulary_is_rejected(tiny_model_dirs, tiny_text_model_dir):
    with pytest.raises(ValueError, match="share the target's tokenizer"):
        LLM(str(tiny_model_dirs["llama"]), skip_tokenizer_init=True, max_model_len=64,
            speculative_config=draft_config(tiny_text_model_dir))


def test_batch_gate_pauses_drafting_that_loses():
    """Drafted steps slower per token than plain ones close the gate for a while, twice as
    long while they keep losing; with no plain steps seen it pauses to measure some."""
    gate = BatchGate()
    for _ in range(BatchGate.PROBE):
        assert gate.open()
        gate.record(8, 20, 0.010, drafted=True)
    assert not gate.open()  # no plain steps at batch 8 yet: measure them
    for _ in range(BatchGate.PROBE):
        gate.record(8, 8, 0.001, drafted=False)  # 8,000 tok/s plain vs 2,000 drafted
    assert gate.open()
    gate.record(8, 20, 0.010, drafted=True)
    assert gate.pause == BatchGate.FIRST_PAUSE
    for _ in range(BatchGate.FIRST_PAUSE):
        gate.record(8, 8, 0.001, drafted=False)
    gate.record(8, 20, 0.010, drafted=True)
    assert gate.pause == 2 * BatchGate.FIRST_PAUSE
    fast = BatchGate()
    for _ in range(8):
        fast.record(8, 8, 0.001, drafted=False)  # 8,000 tok/s plain
    fast.record(8, 40, 0.002, drafted=True)  # 20,000 tok/s drafted: keeps drafting
    assert fast.open()
    # A step weighs by its length: one short lucky step does not outweigh a long slow one.
    fast.record(8, 10, 0.010, drafted=True)
    fast.record(8, 9, 0.0005, drafted=True)
    plain, spec = fast.rates(8)
    assert spec < plain and not fast.open()


def test_abort_while_speculating(tiny_model_dirs, drafts_always_pay):
    """A request aborted between speculative steps frees its blocks at once; the others go
    on to the tokens they would give without speculation."""
    prompts = repetitive_prompts(4, seed=29)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    kw = dict(skip_tokenizer_init=True, max_model_len=160, block_size=4)
    want = ids(LLM(str(tiny_model_dirs["qwen2"]), **kw).generate(prompts, params,
                                                                 use_tqdm=False))
    eng = LLM(str(tiny_model_dirs["qwen2"]), speculative_config=NGRAM, **kw).engine
    for i, p in enumerate(prompts):
        eng.add_request(p, params, request_id=f"r{i}")
    final = {}
    for _ in range(4):
        final.update({o.request_id: o.outputs[0].token_ids for o in eng.step() if o.finished})
    assert eng.stats["spec_decode_num_drafts"] > 0
    used = eng.scheduler.pool.num_free
    assert eng.abort_request("r1")
    assert eng.scheduler.pool.num_free > used
    while eng.has_unfinished_requests():
        final.update({o.request_id: o.outputs[0].token_ids for o in eng.step() if o.finished})
    assert [final[f"r{i}"] for i in (0, 2, 3)] == [want[i] for i in (0, 2, 3)]
    assert eng.scheduler.pool.all_free()
