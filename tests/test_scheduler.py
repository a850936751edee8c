"""Block pool, preemption by recompute, aborts: every block comes back."""

import random

import pytest

from minivllm import LLM, SamplingParams
from minivllm.engine.block_pool import BlockPool, NoFreeBlocksError
from conftest import random_prompts


def test_block_pool_allocate_share_free():
    pool = BlockPool(3)
    a, b, c = pool.allocate(), pool.allocate(), pool.allocate()
    assert pool.num_free == 0
    with pytest.raises(NoFreeBlocksError):
        pool.allocate()
    pool.share(a)
    pool.free(a)
    assert pool.num_free == 0  # still held once
    for blk in (a, b, c):
        pool.free(blk)
    assert pool.all_free()
    with pytest.raises(AssertionError):
        pool.free(a)


def _llm(model_dir, **kw):
    kw.setdefault("max_model_len", 64)
    return LLM(str(model_dir), skip_tokenizer_init=True, **kw)


def test_preemption_is_invisible(tiny_model_dirs):
    model_dir = tiny_model_dirs["qwen2"]
    prompts = random_prompts(6, 256, 8, 20, seed=3)
    greedy = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    seeded = [SamplingParams(temperature=0.9, top_p=0.9, seed=100 + i, max_tokens=30,
                             ignore_eos=True) for i in range(6)]
    free_run = _llm(model_dir, block_size=4)
    want_greedy = [o.outputs[0].token_ids for o in free_run.generate(prompts, greedy, use_tqdm=False)]
    want_seeded = [o.outputs[0].token_ids for o in free_run.generate(prompts, seeded, use_tqdm=False)]
    assert free_run.engine.scheduler.num_preemptions == 0

    # 16 blocks x 4 tokens = 64 tokens: one sequence fits, six at ~45 tokens cannot.
    tight = _llm(model_dir, block_size=4, num_kv_blocks=16)
    got_greedy = [o.outputs[0].token_ids for o in tight.generate(prompts, greedy, use_tqdm=False)]
    got_seeded = [o.outputs[0].token_ids for o in tight.generate(prompts, seeded, use_tqdm=False)]
    assert tight.engine.scheduler.num_preemptions > 0
    assert got_greedy == want_greedy
    assert got_seeded == want_seeded
    assert tight.engine.scheduler.pool.all_free()
    assert not tight.engine.scheduler.running and not tight.engine.scheduler.waiting


def test_abort_mid_generation_frees_blocks(tiny_model_dirs):
    llm = _llm(tiny_model_dirs["llama"], block_size=4)
    eng = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for i, p in enumerate(random_prompts(4, 256, 5, 15, seed=4)):
        eng.add_request(p, params, request_id=f"r{i}")
    for _ in range(5):
        eng.step()
    assert eng.scheduler.pool.num_free < eng.scheduler.pool.num_blocks
    for i in range(4):
        assert eng.abort_request(f"r{i}")
    assert eng.scheduler.pool.all_free()
    assert not eng.has_unfinished_requests()
    assert eng.step() == []
    assert not eng.abort_request("r0")  # aborting twice is harmless


def test_random_add_abort_finish_keeps_pool_whole(tiny_model_dirs):
    llm = _llm(tiny_model_dirs["qwen3"], block_size=4, num_kv_blocks=24, max_num_seqs=6)
    eng = llm.engine
    rng = random.Random(0)
    live: list[str] = []
    next_id = 0
    for op in range(200):
        choice = rng.random()
        if choice < 0.35:
            n = rng.choice([1, 1, 2, 3])
            params = SamplingParams(temperature=rng.choice([0.0, 1.0]), n=n, seed=op,
                                    max_tokens=rng.randint(1, 25), ignore_eos=True)
            prompt = [rng.randrange(3, 256) for _ in range(rng.randint(1, 30))]
            rid = f"q{next_id}"
            next_id += 1
            eng.add_request(prompt, params, request_id=rid)
            live.append(rid)
        elif choice < 0.5 and live:
            eng.abort_request(live.pop(rng.randrange(len(live))))
        else:
            for out in eng.step():
                if out.finished:
                    live.remove(out.request_id)
                    assert all(c.finish_reason == "length" for c in out.outputs)
        # Invariant: blocks held by sequences + free blocks account for the whole pool.
        pool = eng.scheduler.pool
        held = sum(len(s.block_table) for s in eng.scheduler.running)
        assert pool.num_free + held >= pool.num_blocks
    for rid in list(live):
        eng.abort_request(rid)
    assert eng.scheduler.pool.all_free()
    assert eng.scheduler.num_preemptions > 0
