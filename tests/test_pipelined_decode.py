"""Pipelined greedy decoding (step N+1 launched before step N's tokens are read) gives
exactly the output of plain step-by-step decoding, whatever stops, aborts or preemptions
happen in between. Run here through the decode-graph runner in eager mode on the CPU."""

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


def _with_mixed_runner(llm, max_tokens=32):
    """The mixed-step runner as the engine builds it on a GPU: graph buckets up to
    max_tokens (run eagerly here), longer steps up to the token budget."""
    from minivllm.worker.mixed_graph_runner import MixedGraphRunner

    runner, cfg = llm.engine.runner, llm.engine.config
    runner.mixed_runner = MixedGraphRunner(
        runner.model, runner.kv_cache.layers, max_tokens=max_tokens, max_seqs=cfg.max_num_seqs,
        max_blocks=cfg.max_blocks_per_seq(), max_model_len=cfg.max_model_len,
        device=torch.device("cpu"), use_graphs=False,
        max_eager_tokens=cfg.max_num_batched_tokens)
    mixed_ahead = []
    orig = runner._launch_mixed
    runner._launch_mixed = lambda batch, prev: mixed_ahead.append(prev is not None) or orig(
        batch, prev)
    return mixed_ahead


def _staggered(eng, arrivals, steps_between=3):
    """Add each group of (request id, prompt, params) a few steps after the previous one,
    then run to the end; returns the final outputs by request id."""
    final = {}
    for group in arrivals:
        for rid, prompt, params in group:
            eng.add_request(prompt, params, request_id=rid)
        for _ in range(steps_between):
            for o in eng.step():
                if o.finished:
                    final[o.request_id] = o
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                final[o.request_id] = o
    assert not eng.step()  # reads back a step still pending for finished sequences
    return final


def test_new_requests_join_pending_decodes_in_a_mixed_step(tiny_model_dirs, monkeypatch):
    """Requests arriving while decode steps are in flight join them in a mixed step that is
    launched ahead too (its decode rows read their tokens on the device): the outputs equal
    step-by-step decoding's, with stops, seeded sampling, a prompt longer than the largest
    bucket (an eager step, launched ahead too) and a request that is not pipelinable."""
    prompts = random_prompts(9, 256, 3, 14, seed=41)
    long_prompt = random_prompts(1, 256, 40, 40, seed=42)[0]  # > 32 tokens: no mixed graph
    free = _llm(tiny_model_dirs["llama"], monkeypatch, False)[0].generate(
        prompts[:2], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
        use_tqdm=False)
    stop_id = free[1].outputs[0].token_ids[5]
    greedy = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    arrivals = [
        [("a0", prompts[0], greedy), ("a1", prompts[1], SamplingParams(
            temperature=0.0, max_tokens=14, stop_token_ids=[stop_id]))],
        [("b0", prompts[2], greedy),
         ("b1", prompts[3], SamplingParams(temperature=0.9, seed=5, max_tokens=10,
                                           ignore_eos=True))],
        [("c0", prompts[4], greedy), ("c1", long_prompt, greedy)],
        [("d0", prompts[5], SamplingParams(temperature=0.0, max_tokens=8, logprobs=1,
                                           ignore_eos=True)), ("d1", prompts[6], greedy)],
        [("e0", prompts[7], greedy), ("e1", prompts[8], greedy)],
    ]
    results = {}
    for pipelined in (False, True):
        llm, _ = _llm(tiny_model_dirs["llama"], monkeypatch, pipelined)
        mixed_ahead = _with_mixed_runner(llm)
        results[pipelined] = _staggered(llm.engine, arrivals)
        assert llm.engine.scheduler.pool.all_free() and llm.engine._pending is None
    for rid, want in results[False].items():
        got = results[True][rid]
        assert got.outputs[0].token_ids == want.outputs[0].token_ids, rid
        assert got.outputs[0].finish_reason == want.outputs[0].finish_reason, rid
        assert PLACEHOLDER_TOKEN not in got.outputs[0].token_ids
    assert len(results[True]) == 10
    assert any(mixed_ahead)  # some mixed steps were launched with decodes still in flight


def test_speculation_between_pipelined_steps(tiny_model_dirs, monkeypatch):
    """With n-gram speculation, sequences that are not due to draft (backing off after a
    miss) decode in pipelined steps, and drafted steps run synchronously: the greedy
    output is the plain engine's, with both kinds of step taken."""
    rng = __import__("random").Random(23)
    prompts = random_prompts(3, 256, 10, 30, seed=23)
    for i in range(3):
        phrase = [rng.randrange(3, 250) for _ in range(5 + i)]
        prompts.append(phrase * 4)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    want = _llm(tiny_model_dirs["qwen2"], monkeypatch, False)[0].generate(
        prompts, params, use_tqdm=False)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    from minivllm.engine.speculative import BatchGate, StepCost
    monkeypatch.setattr(StepCost, "token_share", lambda self, tokens: 0.0)  # timing aside
    monkeypatch.setattr(BatchGate, "open", lambda self: True)
    llm, launches = _llm(tiny_model_dirs["qwen2"], monkeypatch, True, speculative_config=spec)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert any(launches)  # some steps launched behind a pending one
    assert llm.engine.stats["spec_decode_num_accepted_tokens"] > 0
    assert llm.engine.scheduler.pool.all_free()


def test_requests_one_after_another_behind_a_pending_step(tiny_model_dirs, monkeypatch):
    """generate() called again and again with one prompt that stops on a token: each call
    ends with a step still pending (launched before the stop was read), and the next
    prompt's steps go behind it, also when its prompt is all cached but one token (its
    first step is then a decode-sized step that takes nothing from the pending one). The
    outputs equal step-by-step decoding's."""
    prompts = [random_prompts(1, 256, n, n, seed=43 + n)[0] for n in (5, 9, 13, 6)]
    free = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    llm, _ = _llm(tiny_model_dirs["llama"], monkeypatch, False)
    stops = [o.outputs[0].token_ids[4] for o in llm.generate(prompts, free, use_tqdm=False)]
    results = {}
    for pipelined in (False, True):
        llm, launches = _llm(tiny_model_dirs["llama"], monkeypatch, pipelined)
        _with_mixed_runner(llm)
        results[pipelined] = [
            llm.generate([p], SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[
                stop]), use_tqdm=False)[0].outputs[0].token_ids
            for _ in range(2) for p, stop in zip(prompts, stops)]
        assert llm.engine.scheduler.pool.all_free()
    assert results[True] == results[False]
    assert any(launches)


def test_long_prompts_launched_ahead_across_chunks(tiny_model_dirs, monkeypatch):
    """Prompts longer than the graph buckets and the token budget: their steps run eagerly
    through the mixed-step runner and are launched ahead of the pending step, also when a
    prompt is split over steps (a sequence between chunks knows its last token, so the
    next chunk needs nothing from the pending step). Outputs equal step-by-step decoding's;
    a prompt's chunks and the decodes of prompts already done share steps."""
    prompts = random_prompts(5, 256, 50, 90, seed=47)
    params = [SamplingParams(temperature=0.0, max_tokens=1 + 4 * i, ignore_eos=True)
              for i in range(4)] + [SamplingParams(temperature=0.8, seed=2, max_tokens=6,
                                                   ignore_eos=True)]
    results, kinds = {}, {}
    for pipelined in (False, True):
        llm, _ = _llm(tiny_model_dirs["qwen3"], monkeypatch, pipelined,
                      max_num_batched_tokens=64)
        mixed_ahead = _with_mixed_runner(llm, max_tokens=16)
        runner = llm.engine.runner
        seen = kinds[pipelined] = []
        orig = runner.mixed_runner.run
        runner.mixed_runner.run = lambda host, *a: seen.append(
            (len(host.input_ids), bool(a and a[0]))) or orig(host, *a)
        results[pipelined] = llm.generate(prompts, params, use_tqdm=False)
        assert llm.engine.scheduler.pool.all_free()
    for want, got in zip(results[False], results[True]):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        assert PLACEHOLDER_TOKEN not in got.outputs[0].token_ids
    long_steps = [fix for n, fix in kinds[True] if n > 16]
    assert len(long_steps) >= 4 and any(mixed_ahead)
    # Some long steps took decode tokens from the pending step on the device.
    assert any(long_steps)


def test_sampled_penalized_and_logprob_rows_pipeline(tiny_model_dirs, monkeypatch):
    """Sampled rows (seeded and not), penalties, min_tokens and logprobs all take part in
    pipelined decoding (their state lives on the device): the same tokens, logprobs and
    finish reasons as step-by-step decoding, with most steps launched ahead."""
    prompts = random_prompts(8, 256, 5, 25, seed=8)
    params = [SamplingParams(temperature=0.9, top_k=30, top_p=0.9, seed=1, max_tokens=20,
                             ignore_eos=True, repetition_penalty=1.2),
              SamplingParams(temperature=0.7, max_tokens=18, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.0, frequency_penalty=0.8, presence_penalty=0.4,
                             max_tokens=22, ignore_eos=True),
              SamplingParams(temperature=1.1, min_p=0.1, min_tokens=6, max_tokens=16,
                             seed=4),
              SamplingParams(temperature=0.0, logprobs=1, logit_bias={9: 3.0},
                             max_tokens=15, ignore_eos=True)] * 2
    params = params[:8]
    runs = []
    for pipelined in (False, True):
        llm, launches = _llm(tiny_model_dirs["qwen3"], monkeypatch, pipelined)
        _with_mixed_runner(llm)
        outs = llm.generate(prompts, params, use_tqdm=False)
        runs.append([(c.token_ids, c.finish_reason,
                      [{t: round(lp.logprob, 4) for t, lp in d.items()} for d in c.logprobs]
                      if c.logprobs else None) for o in outs for c in o.outputs])
        assert llm.engine.scheduler.pool.all_free()
    assert runs[0] == runs[1]
    assert sum(launches) > 10


def test_outputs_that_fill_the_context_pipelined(tiny_model_dirs, monkeypatch):
    """Offline, an output runs until the context is full ("length"), and a prompt that
    fills it exactly gets one token (vLLM's offline rule). Prompts join running decodes in
    mixed steps launched ahead, so a step is launched behind the one that samples a full
    prompt's token: it must not compute a position past the context."""
    from minivllm.worker.mixed_graph_runner import MixedGraphRunner

    limit = 32
    prompts = [list(range(3, 3 + limit)), list(range(5, 5 + limit - 1))] * 2
    prompts += random_prompts(2, 256, 10, 20, seed=23)
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    kw = dict(max_model_len=limit, max_num_batched_tokens=24)
    want = _llm(tiny_model_dirs["llama"], monkeypatch, False, **kw)[0].generate(
        prompts, params, use_tqdm=False)
    piped, launches = _llm(tiny_model_dirs["llama"], monkeypatch, True, **kw)
    runner, cfg = piped.engine.runner, piped.engine.config
    runner.mixed_runner = MixedGraphRunner(
        runner.model, runner.kv_cache.layers, max_tokens=24, max_seqs=cfg.max_num_seqs,
        max_blocks=cfg.max_blocks_per_seq(), max_model_len=limit,
        device=torch.device("cpu"), use_graphs=False)
    runner.mixed_runner.capture()
    got = piped.generate(prompts, params, use_tqdm=False)
    for p, w, g in zip(prompts, want, got):
        assert len(g.outputs[0].token_ids) == max(1, limit - len(p))
        assert g.outputs[0].finish_reason == "length"
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
    assert sum(launches) > 5
    assert piped.engine.scheduler.pool.all_free()


def test_bad_words_and_allowed_tokens_pipelined(tiny_text_model_dir, monkeypatch):
    """bad_words' per-step bans read the pending step's token (a placeholder on the host)
    and allowed_token_ids ride on the slot's bias: pipelined output equals step-by-step
    output, and differs from the unconstrained one where a word was banned."""
    kw = dict(skip_tokenizer_init=False, max_model_len=128)
    plain = _llm(tiny_text_model_dir, monkeypatch, False, **kw)[0]
    prompts = ["The quick brown fox", "Once upon a time"]
    greedy = dict(temperature=0.0, max_tokens=24, ignore_eos=True)
    tok = plain.get_tokenizer()
    free = [o.outputs[0].token_ids for o in plain.generate(
        prompts, SamplingParams(**greedy), use_tqdm=False)]
    words = [tok.decode(f[5:7]) for f in free]
    params = [SamplingParams(bad_words=[words[0]], **greedy),
              SamplingParams(bad_words=[words[1], "zebra crossing"], **greedy),
              SamplingParams(allowed_token_ids=sorted(set(free[0]))[:4], **greedy)]
    prompts.append(prompts[0])
    want = plain.generate(prompts, params, use_tqdm=False)
    piped, launches = _llm(tiny_text_model_dir, monkeypatch, True, **kw)
    got = piped.generate(prompts, params, use_tqdm=False)
    assert [g.outputs[0].token_ids for g in got] == [w.outputs[0].token_ids for w in want]
    assert sum(launches) > 5
    assert got[0].outputs[0].token_ids != free[0] or got[1].outputs[0].token_ids != free[1]
    assert set(got[2].outputs[0].token_ids) <= set(sorted(set(free[0]))[:4])
