"""Prefix caching: shared prompt prefixes reuse computed KV blocks, and output never
changes because of it."""

import random


from minivllm import LLM, SamplingParams
from minivllm.engine.block_pool import BlockPool, block_hash
from conftest import random_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _llm(model_dir, caching=True, **kw):
    kw.setdefault("max_model_len", 256)
    kw.setdefault("block_size", 4)
    return LLM(str(model_dir), skip_tokenizer_init=True, enable_prefix_caching=caching, **kw)


def _ids(outs):
    return [c.token_ids for o in outs for c in o.outputs]


def test_block_pool_cache_and_eviction():
    pool = BlockPool(2)
    a = pool.allocate()
    h = block_hash(None, [1, 2, 3, 4])
    pool.register(a, h)
    pool.free(a)
    assert pool.lookup([h]) == [a] and pool.num_reusable_free([a]) == 1
    pool.share(a)  # revived from the free queue
    assert pool.num_free == 1 and pool.refcount(a) == 1
    pool.free(a)
    pool.allocate()  # takes the other block first (a was freed later)
    assert pool.lookup([h]) == [a]
    pool.allocate()  # now a is evicted
    assert pool.lookup([h]) == []
    assert block_hash(h, [5]) != block_hash(None, [5])


def test_shared_prefix_hits_and_same_output(tiny_model_dirs):
    rng = random.Random(0)
    system = [rng.randrange(3, 256) for _ in range(41)]
    prompts = [system + [rng.randrange(3, 256) for _ in range(rng.randint(1, 9))]
               for _ in range(5)]
    plain = _ids(_llm(tiny_model_dirs["llama"], caching=False).generate(
        prompts, GREEDY, use_tqdm=False))
    llm = _llm(tiny_model_dirs["llama"])
    first = llm.generate(prompts[:1], GREEDY, use_tqdm=False)
    assert first[0].num_cached_tokens == 0
    rest = llm.generate(prompts[1:], GREEDY, use_tqdm=False)
    assert _ids(first + rest) == plain
    assert all(o.num_cached_tokens == 40 for o in rest)  # 10 full blocks of the prefix
    assert llm.engine.scheduler.pool.cache_hits >= 40
    assert llm.engine.scheduler.pool.all_free()


def test_multi_turn_reuses_the_whole_history(tiny_model_dirs):
    llm = _llm(tiny_model_dirs["qwen2"])
    turn1 = random_prompts(1, 256, 30, 30, seed=5)[0]
    out1 = llm.generate([turn1], GREEDY, use_tqdm=False)[0]
    turn2 = turn1 + out1.outputs[0].token_ids + [7, 8, 9]
    out2 = llm.generate([turn2], GREEDY, use_tqdm=False)[0]
    assert out2.num_cached_tokens == (len(turn1) + 8 - 1) // 4 * 4
    plain = _llm(tiny_model_dirs["qwen2"], caching=False).generate([turn2], GREEDY,
                                                                    use_tqdm=False)
    assert out2.outputs[0].token_ids == plain[0].outputs[0].token_ids


def test_whole_prompt_cached_still_computes_the_last_token(tiny_model_dirs):
    llm = _llm(tiny_model_dirs["qwen3"])
    prompt = random_prompts(1, 256, 32, 32, seed=6)[0]  # exactly 8 blocks
    a = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    b = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert b.num_cached_tokens == 28  # the last block is recomputed for its logits
    assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_prompt_logprobs_bypass_the_cache(tiny_model_dirs):
    llm = _llm(tiny_model_dirs["llama"])
    prompt = random_prompts(1, 256, 20, 20, seed=7)[0]
    llm.generate([prompt], GREEDY, use_tqdm=False)
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=1)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    assert out.num_cached_tokens == 0
    assert len(out.prompt_logprobs) == 20 and out.prompt_logprobs[-1] is not None


def test_caching_under_pressure_and_preemption(tiny_model_dirs):
    rng = random.Random(1)
    base = [rng.randrange(3, 256) for _ in range(24)]
    prompts = [base[:rng.randint(8, 24)] + [rng.randrange(3, 256) for _ in range(4)]
               for _ in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    plain = _ids(_llm(tiny_model_dirs["qwen2"], caching=False, max_model_len=64).generate(
        prompts, params, use_tqdm=False))
    tight = _llm(tiny_model_dirs["qwen2"], max_model_len=64, num_kv_blocks=20)
    got = _ids(tight.generate(prompts, params, use_tqdm=False))
    assert got == plain
    sched = tight.engine.scheduler
    assert sched.num_preemptions > 0 and sched.pool.cache_hits > 0
    assert sched.pool.all_free()
