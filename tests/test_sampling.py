"""Sampling: seeds, logprobs, stops, min_tokens, n > 1, penalties, top-k/top-p."""

import dataclasses

import pytest
import torch

from minivllm import LLM, SamplingParams
from conftest import random_prompts


@pytest.fixture(scope="module")
def llm(tiny_model_dirs):
    return LLM(str(tiny_model_dirs["llama"]), skip_tokenizer_init=True, max_model_len=256,
               block_size=4)


@pytest.fixture(scope="module")
def text_llm(tiny_text_model_dir):
    return LLM(str(tiny_text_model_dir), max_model_len=512, block_size=16)


def _ids(outs):
    return [c.token_ids for o in outs for c in o.outputs]


def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    prompt = [11, 22, 33, 44, 55]
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=20, ignore_eos=True)
    alone = _ids(llm.generate([prompt], params, use_tqdm=False))[0]
    again = _ids(llm.generate([prompt], params, use_tqdm=False))[0]
    others = random_prompts(5, 256, 3, 40, seed=9)
    mixed = llm.generate(others[:2] + [prompt] + others[2:],
                         [SamplingParams(temperature=0.7, max_tokens=25, ignore_eos=True)] * 2
                         + [params] + [SamplingParams(temperature=0.0, max_tokens=7)] * 3,
                         use_tqdm=False)
    assert alone == again
    assert mixed[2].outputs[0].token_ids == alone
    other_seed = _ids(llm.generate([prompt], SamplingParams(temperature=1.0, seed=99,
                                   max_tokens=20, ignore_eos=True), use_tqdm=False))[0]
    assert other_seed != alone


def test_logprobs_match_reference_logits(llm, tiny_model_dirs):
    from transformers import AutoModelForCausalLM

    prompt = random_prompts(1, 256, 12, 12, seed=5)[0]
    out = llm.generate([prompt], SamplingParams(temperature=0.8, seed=3, max_tokens=8,
                       logprobs=5, prompt_logprobs=3, ignore_eos=True), use_tqdm=False)[0]
    comp = out.outputs[0]
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dirs["llama"], dtype=torch.float32)
    full = torch.tensor([prompt + comp.token_ids])
    with torch.no_grad():
        ref = torch.log_softmax(hf(full).logits[0].float(), dim=-1)
    n = len(prompt)
    assert len(comp.logprobs) == len(comp.token_ids)
    total = 0.0
    for j, (tok, lps) in enumerate(zip(comp.token_ids, comp.logprobs)):
        row = ref[n - 1 + j]
        assert abs(lps[tok].logprob - row[tok].item()) < 1e-4
        assert lps[tok].rank == int((row > row[tok]).sum()) + 1
        top_vals, top_ids = row.topk(5)
        for tid, val in zip(top_ids.tolist(), top_vals.tolist()):
            assert abs(lps[tid].logprob - val) < 1e-4
        total += lps[tok].logprob
    assert abs(comp.cumulative_logprob - total) < 1e-3
    # Prompt logprobs: None for the first token, then the actual token's + top-3.
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == n
    for p in range(1, n):
        entry = out.prompt_logprobs[p]
        assert abs(entry[prompt[p]].logprob - ref[p - 1, prompt[p]].item()) < 1e-4
        assert len(entry) in (3, 4)


def test_prompt_logprobs_survive_chunked_prefill(tiny_model_dirs):
    small = LLM(str(tiny_model_dirs["llama"]), skip_tokenizer_init=True, max_model_len=256,
                block_size=4, max_num_batched_tokens=8, max_num_seqs=4)
    prompt = random_prompts(1, 256, 30, 30, seed=6)[0]
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=1)
    chunked = small.generate([prompt], params, use_tqdm=False)[0].prompt_logprobs
    llm = LLM(str(tiny_model_dirs["llama"]), skip_tokenizer_init=True, max_model_len=256)
    whole = llm.generate([prompt], params, use_tqdm=False)[0].prompt_logprobs
    assert len(chunked) == len(whole) == 30
    for a, b in zip(chunked[1:], whole[1:]):
        assert a.keys() == b.keys()
        for k in a:
            assert abs(a[k].logprob - b[k].logprob) < 1e-4


def test_stop_token_ids_and_min_tokens(llm):
    prompt = [7, 8, 9, 10]
    free = _ids(llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=20,
                                                      ignore_eos=True), use_tqdm=False))[0]
    stop_id = free[4]
    first = free.index(stop_id)
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=20,
                       stop_token_ids=[stop_id]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == free[:first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    # min_tokens bans the stop token until enough tokens exist.
    banned = free[0]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=20, min_tokens=5,
                       stop_token_ids=[banned]), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) >= 5
    assert banned not in out.token_ids[:5]


def test_a_stop_tokens_text_is_left_out_unless_asked(text_llm):
    """As vLLM's: the token that ends a sequence (a stop_token_ids hit; EOS, whose text
    shows with skip_special_tokens=False) is in token_ids, its text in the output only
    with include_stop_str_in_output."""
    tok = text_llm.get_tokenizer()
    prompt = "The capital of France is"
    free = text_llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12,
                                                      ignore_eos=True), use_tqdm=False)
    free = free[0].outputs[0]
    stop_id = free.token_ids[4]
    last = free.token_ids.index(stop_id)
    eos = tok.eos_token_id
    texts = {}
    for keep in (False, True):
        out = text_llm.generate([prompt], SamplingParams(
            temperature=0.0, max_tokens=12, stop_token_ids=[stop_id],
            include_stop_str_in_output=keep), use_tqdm=False)[0].outputs[0]
        assert out.token_ids == free.token_ids[:last + 1] and out.stop_reason == stop_id
        texts[keep] = out.text
        forced = text_llm.generate([prompt], SamplingParams(
            temperature=0.0, max_tokens=12, logit_bias={eos: 100.0}, skip_special_tokens=False,
            include_stop_str_in_output=keep), use_tqdm=False)[0].outputs[0]
        assert forced.token_ids == [eos] and forced.finish_reason == "stop"
        assert forced.text == (tok.decode([eos], skip_special_tokens=False) if keep else "")
    assert texts[True] == texts[False] + tok.decode([stop_id])
    assert free.text.startswith(texts[True])


def test_eos_stops_unless_ignored(llm):
    prompt = [7, 8, 9, 10]
    free = _ids(llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=20,
                                                      ignore_eos=True), use_tqdm=False))[0]
    # Treat the third generated token as the end-of-sequence token.
    eos = free[2]
    eng = llm.engine
    saved = eng.eos_token_ids
    eng.eos_token_ids = frozenset([eos])
    try:
        out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=20),
                           use_tqdm=False)[0].outputs[0]
        ignored = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=20,
                               ignore_eos=True), use_tqdm=False)[0].outputs[0]
    finally:
        eng.eos_token_ids = saved
    assert out.token_ids == free[:free.index(eos) + 1] and out.finish_reason == "stop"
    assert ignored.token_ids == free and ignored.finish_reason == "length"


def test_n_samples_share_the_prompt(llm):
    prompt = random_prompts(1, 256, 37, 37, seed=7)[0]  # 37 tokens: a partial last block
    out = llm.generate([prompt], SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=10,
                       ignore_eos=True), use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    samples = [c.token_ids for c in out.outputs]
    assert len({tuple(s) for s in samples}) > 1
    # Each sample equals a single request with seed + index.
    for i, s in enumerate(samples):
        single = llm.generate([prompt], SamplingParams(temperature=1.0, seed=7 + i,
                              max_tokens=10, ignore_eos=True), use_tqdm=False)[0]
        assert single.outputs[0].token_ids == s
    greedy = llm.generate([prompt], SamplingParams(n=3, temperature=0.0, max_tokens=10,
                          ignore_eos=True), use_tqdm=False)[0]
    assert len({tuple(c.token_ids) for c in greedy.outputs}) == 1
    assert llm.engine.scheduler.pool.all_free()


def test_penalties_and_truncation_change_sampling(llm):
    prompt = [5, 6, 7, 8, 9]
    base = _ids(llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=30,
                                                      ignore_eos=True), use_tqdm=False))[0]
    rep = _ids(llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=30,
               repetition_penalty=2.0, ignore_eos=True), use_tqdm=False))[0]
    freq = _ids(llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=30,
                frequency_penalty=2.0, presence_penalty=2.0, ignore_eos=True), use_tqdm=False))[0]
    assert rep != base and freq != base
    # Strong presence penalty makes repeats rarer than in plain greedy decoding.
    assert len(set(freq)) >= len(set(base))
    # top_k=1 is greedy whatever the temperature; a tiny top_p too.
    for p in (SamplingParams(temperature=1.5, top_k=1, seed=1, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=1.5, top_p=1e-6, seed=1, max_tokens=30,
                             ignore_eos=True),
              SamplingParams(temperature=1.5, min_p=1.0, seed=1, max_tokens=30,
                             ignore_eos=True)):
        assert _ids(llm.generate([prompt], p, use_tqdm=False))[0] == base


def test_stop_strings(text_llm):
    prompt = "The quick brown fox"
    free = text_llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=40,
                             ignore_eos=True), use_tqdm=False)[0].outputs[0].text
    assert len(free) > 20
    stop = free[10:14]
    cut = free.index(stop)
    out = text_llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=40,
                            stop=[stop, "zzzz-never"], ignore_eos=True), use_tqdm=False)[0]
    comp = out.outputs[0]
    assert comp.text == free[:cut]
    assert comp.finish_reason == "stop" and comp.stop_reason == stop
    kept = text_llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=40, stop=stop,
                             include_stop_str_in_output=True, ignore_eos=True),
                             use_tqdm=False)[0].outputs[0]
    assert kept.text == free[:cut + len(stop)]


def test_streamed_text_never_shows_a_partial_stop(text_llm):
    eng = text_llm.engine
    free = text_llm.generate("Once upon a time", SamplingParams(temperature=0.0, max_tokens=30,
                             ignore_eos=True), use_tqdm=False)[0].outputs[0].text
    stop = free[8:16]
    eng.add_request("Once upon a time", SamplingParams(temperature=0.0, max_tokens=30,
                    stop=[stop], ignore_eos=True), request_id="s")
    seen = []
    while eng.has_unfinished_requests():
        for out in eng.step():
            seen.append(out.outputs[0].text)
    for earlier, later in zip(seen, seen[1:]):
        assert later.startswith(earlier)  # streamed text only grows
    assert seen[-1] == free[:free.index(stop)]
    assert all(stop[:3] not in t[len(seen[-1]):] for t in seen)


def test_incremental_detokenization_never_breaks_characters(text_llm):
    text = "naïve café — 東京タワー 🚀🎉 ok"
    ids = text_llm.get_tokenizer().encode(text, add_special_tokens=False)
    from minivllm.engine.detokenizer import Detokenizer
    from minivllm.engine.sequence import Request, Sequence

    detok = Detokenizer(text_llm.get_tokenizer())
    prompt = text_llm.get_tokenizer().encode("Hello", add_special_tokens=False)
    req = Request("x", None, prompt, SamplingParams())
    seq = Sequence(0, req, 0, req.params)
    pieces = []
    for t in ids:
        seq.token_ids.append(t)
        pieces.append(detok.append_text(seq))
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text_llm.get_tokenizer().decode(ids)


def test_detokenizer_decodes_with_the_rust_tokenizer_when_equivalent(text_llm):
    """The windows are decoded by the Rust tokenizer directly (the transformers wrapper
    cost ~2 ms per step at batch 256), only where that gives tokenizer.decode's text."""
    from minivllm.engine.detokenizer import Detokenizer, _fast_decode

    tok = text_llm.get_tokenizer()
    assert Detokenizer(tok)._window_decode == tok.backend_tokenizer.decode
    ids = tok.encode("Hello <|im_start|> world, naïve 東京 🚀", add_special_tokens=False)
    for skip in (True, False):
        assert tok.backend_tokenizer.decode(ids, skip_special_tokens=skip) == tok.decode(
            ids, skip_special_tokens=skip)

    class CleansSpaces:  # a wrapper that does more than the Rust decode: not bypassed
        backend_tokenizer = tok.backend_tokenizer
        clean_up_tokenization_spaces = True

    assert _fast_decode(CleansSpaces()) is None


def test_logit_bias(llm):
    prompt = [7, 8, 9]
    forced = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=5,
                          ignore_eos=True, logit_bias={17: 100.0}), use_tqdm=False)
    assert forced[0].outputs[0].token_ids == [17] * 5
    free = _ids(llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=5,
                             ignore_eos=True), use_tqdm=False))[0]
    banned = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=5,
                          ignore_eos=True, logit_bias={free[0]: -100.0}), use_tqdm=False)
    assert banned[0].outputs[0].token_ids[0] != free[0]


# 3 chunks of 1,024 (the last one masked: 452 logits) and 1; 7 rows of each through the
# interpreter (slow); realistic sizes: GPU tests
@pytest.mark.parametrize("vocab", [2500, 1000])
def test_argmax_kernel_is_argmax(vocab):
    """The two-stage argmax kernel of the graphed steps (csrc_triton.argmax_rows, under
    Triton's interpreter here): the first index of each row's maximum, ties across and
    within chunks, infinities, NaN, constant rows included; `out` is written."""
    pytest.importorskip("triton")
    from csrc_triton import argmax_rows as argmax_kernel
    from minivllm.worker.sampler import argmax_rows

    torch.manual_seed(0)
    x = torch.randn(7, vocab).to(torch.bfloat16)
    x[1, 7] = x[1, vocab - 3] = 100.0            # tie across chunks: the first
    x[2] = 0.0                                    # all equal: index 0
    x[3, vocab // 2] = x[3, vocab // 2 + 1] = float("inf")  # tie inside a chunk
    x[4, vocab - 1] = 50.0                        # the very last index
    x[5] = float("-inf")
    x[6, vocab // 3] = x[6, 5] = float("nan")     # NaN counts as the largest
    want = x.argmax(dim=-1)
    assert torch.equal(argmax_kernel(x), want)
    out = torch.full((7,), -1, dtype=torch.long)
    assert argmax_kernel(x.float(), out) is out and torch.equal(out, want)
    assert torch.equal(argmax_rows(x), want)


def test_decode_slots_kernel_matches_torch():
    """The decode rows' positions and KV slots in one kernel (csrc_triton.decode_slots),
    against the PyTorch ops of the eager decode step; a row of length 0 gets slot -1."""
    pytest.importorskip("triton")
    from csrc_triton import decode_slots

    g = torch.Generator().manual_seed(3)
    lens = torch.tensor([5, 0, 17, 1, 64, 65, 1000], dtype=torch.int32)
    tables = torch.randint(0, 500, (7, 80), generator=g, dtype=torch.int32)
    positions = torch.full((9,), 7, dtype=torch.long)
    slots = torch.full((9,), 7, dtype=torch.long)
    decode_slots(lens, tables, 16, positions, slots)
    want_pos = (lens.long() - 1).clamp(min=0)
    blocks = tables.gather(1, (want_pos // 16)[:, None]).squeeze(1).long()
    want_slots = torch.where(lens > 0, blocks * 16 + want_pos % 16, -1)
    assert torch.equal(positions[:7], want_pos) and torch.equal(slots[:7], want_slots)
    assert positions[7:].tolist() == [7, 7] and slots[7:].tolist() == [7, 7]


# ---- penalties, bias and bans against Hugging Face's logits processors ------------------

class FrequencyPresence:
    """OpenAI's frequency and presence penalties as a transformers logits processor (HF
    has none): counts over the generated tokens only."""

    def __init__(self, prompt_len: int, frequency: float, presence: float) -> None:
        self.prompt_len, self.frequency, self.presence = prompt_len, frequency, presence

    def __call__(self, input_ids, scores):
        out = input_ids[:, self.prompt_len:]
        counts = torch.zeros_like(scores)
        counts.scatter_add_(1, out, torch.ones_like(out, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


def hf_processed_greedy(model, prompt, max_new_tokens, eos=None, **kw):
    """HF generate, greedy, with the generation config's processors for repetition_penalty,
    sequence_bias and min_new_tokens, plus FrequencyPresence for those two."""
    from transformers import LogitsProcessorList

    extra = LogitsProcessorList()
    freq, pres = kw.pop("frequency_penalty", 0.0), kw.pop("presence_penalty", 0.0)
    if freq or pres:
        extra.append(FrequencyPresence(len(prompt), freq, pres))
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=0, eos_token_id=eos,
                             logits_processor=extra, **kw)
    tokens = out[0, len(prompt):].tolist()
    return tokens[:tokens.index(eos) + 1] if eos is not None and eos in tokens else tokens


# (ours, HF's) settings of the same processing
PROCESSED = [
    (dict(repetition_penalty=1.6), dict(repetition_penalty=1.6)),
    (dict(repetition_penalty=0.7), dict(repetition_penalty=0.7)),
    (dict(frequency_penalty=1.2, presence_penalty=0.6),
     dict(frequency_penalty=1.2, presence_penalty=0.6)),
    (dict(logit_bias={40: 4.0, 41: -100.0, 90: 2.5}),
     dict(sequence_bias={(40,): 4.0, (41,): -100.0, (90,): 2.5})),
    (dict(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=-0.4,
          logit_bias={17: 1.5}),
     dict(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=-0.4,
          sequence_bias={(17,): 1.5})),
]


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_greedy_processing_matches_hf_logits_processors(tiny_model_dirs, family):
    """Greedy with repetition / frequency / presence penalties and logit_bias gives, token
    for token, what HF generate gives with its logits processors (fp32, tiny models; the
    prompts' own tokens are penalized too, as HF's repetition penalty does)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dirs[family],
                                              dtype=torch.float32).eval()
    llm = LLM(str(tiny_model_dirs[family]), skip_tokenizer_init=True, max_model_len=256,
              block_size=4)
    prompts = random_prompts(3, 256, 5, 20, seed=21)
    for ours, theirs in PROCESSED:
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, **ours)
        got = _ids(llm.generate(prompts, params, use_tqdm=False))
        want = [hf_processed_greedy(hf, p, 24, **dict(theirs)) for p in prompts]
        assert got == want, ours
    plain = _ids(llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24,
                                                      ignore_eos=True), use_tqdm=False))
    assert plain != got  # the processing changed something
    assert llm.engine.scheduler.pool.all_free()


def test_min_tokens_matches_hf(tiny_model_dirs):
    """min_tokens bans EOS until that many tokens exist, as HF's min_new_tokens does, with
    a repetition penalty on top; the token stops the output right after."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dirs["qwen2"],
                                              dtype=torch.float32).eval()
    llm = LLM(str(tiny_model_dirs["qwen2"]), skip_tokenizer_init=True, max_model_len=256,
              block_size=4)
    prompt = random_prompts(1, 256, 9, 9, seed=4)[0]
    free = _ids(llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=30,
                                                      ignore_eos=True), use_tqdm=False))[0]
    eos = free[1]  # stands for EOS: greedy reaches it at once
    saved = llm.engine.eos_token_ids
    llm.engine.eos_token_ids = frozenset([eos])
    try:
        for extra in ({}, {"repetition_penalty": 1.2}):
            got = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=30,
                               min_tokens=6, **extra), use_tqdm=False)[0].outputs[0]
            want = hf_processed_greedy(hf, prompt, 30, eos=eos, min_new_tokens=6, **extra)
            assert got.token_ids == want
            assert eos not in got.token_ids[:6]
    finally:
        llm.engine.eos_token_ids = saved
    assert llm.engine.scheduler.pool.all_free()


@pytest.mark.slow
def test_smollm2_processing_matches_hf(default_model_dir):
    """The real SmolLM2-135M: greedy with a repetition penalty, frequency and presence
    penalties and a logit bias, token for token HF's processors."""
    from transformers import AutoModelForCausalLM

    llm = LLM(str(default_model_dir), max_model_len=512)
    tok = llm.get_tokenizer()
    prompt = tok.encode("Write a list of fruits: apples, pears, apples, plums,")
    hf = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    ours, theirs = PROCESSED[4]
    got = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=20,
                       ignore_eos=True, **ours), use_tqdm=False)[0].outputs[0].token_ids
    assert got == hf_processed_greedy(hf, prompt, 20, **dict(theirs))


# ---- seeded draws: the same in any company --------------------------------------------------

SEEDED = SamplingParams(temperature=0.9, top_k=40, top_p=0.9, repetition_penalty=1.1,
                        seed=2024, max_tokens=30, ignore_eos=True, logprobs=2)


def _company(n: int) -> list[SamplingParams]:
    """A batch's other requests: greedy, unseeded and seeded draws, penalties, logprobs,
    min_tokens, n > 1."""
    kinds = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
             SamplingParams(temperature=1.0, max_tokens=25, ignore_eos=True),
             SamplingParams(temperature=0.7, top_p=0.8, seed=5, max_tokens=18,
                            ignore_eos=True, presence_penalty=0.5),
             SamplingParams(temperature=0.0, repetition_penalty=1.4, max_tokens=20,
                            ignore_eos=True, logprobs=1),
             SamplingParams(temperature=1.1, min_p=0.1, min_tokens=4, max_tokens=16),
             SamplingParams(n=2, temperature=0.8, top_k=20, max_tokens=10, ignore_eos=True)]
    return [kinds[i % len(kinds)] for i in range(n)]


def test_seeded_request_draws_the_same_alone_in_a_batch_and_after_preemption(tiny_model_dirs):
    """A seeded sampled request (top-k, top-p, a penalty, logprobs) gets the same tokens
    and logprobs alone, in a batch of 16 mixed requests, and in a cache so small that
    the batch is preempted; every block comes back."""
    path = str(tiny_model_dirs["llama"])
    prompt = random_prompts(1, 256, 12, 12, seed=3)[0]
    others = random_prompts(15, 256, 6, 30, seed=4)
    llm = LLM(path, skip_tokenizer_init=True, max_model_len=256, block_size=4)
    alone = llm.generate([prompt], SEEDED, use_tqdm=False)[0].outputs[0]
    mixed = llm.generate(others[:7] + [prompt] + others[7:], _company(7) + [SEEDED]
                         + _company(8), use_tqdm=False)
    assert llm.engine.scheduler.pool.all_free()
    small = LLM(path, skip_tokenizer_init=True, max_model_len=128, block_size=4,
                num_kv_blocks=40)
    squeezed = small.generate(others[:7] + [prompt] + others[7:], _company(7) + [SEEDED]
                              + _company(8), use_tqdm=False)
    assert small.engine.scheduler.num_preemptions > 0
    assert small.engine.scheduler.pool.all_free()
    for out in (mixed[7].outputs[0], squeezed[7].outputs[0]):
        assert out.token_ids == alone.token_ids
        for a, b in zip(out.logprobs, alone.logprobs):
            assert a.keys() == b.keys()
            assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)
    # The company's seeded requests too, and a different seed differs.
    assert mixed[2].outputs[0].token_ids == squeezed[2].outputs[0].token_ids
    other = llm.generate([prompt], dataclasses.replace(SEEDED, seed=7),
                         use_tqdm=False)[0].outputs[0]
    assert other.token_ids != alone.token_ids


def test_allowed_token_ids(llm):
    """Only the allowed tokens are drawn, greedy (the best of them) or sampled, logit_bias
    applying among them; an id outside the vocabulary is refused."""
    prompt = [7, 8, 9]
    free = _ids(llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6,
                             ignore_eos=True), use_tqdm=False))[0]
    allowed = [t for t in (40, 41, 42, 43) if t not in free][:3]
    outs = llm.generate([prompt] * 3, [
        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                       allowed_token_ids=allowed),
        SamplingParams(temperature=1.0, seed=5, max_tokens=20, ignore_eos=True,
                       allowed_token_ids=allowed),
        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                       allowed_token_ids=allowed, logit_bias={allowed[1]: 100.0})],
        use_tqdm=False)
    greedy, sampled, biased = (o.outputs[0].token_ids for o in outs)
    assert set(greedy) <= set(allowed) and set(sampled) <= set(allowed)
    assert len(set(sampled)) > 1
    assert biased == [allowed[1]] * 6
    with pytest.raises(ValueError, match="allowed_token_ids"):
        llm.generate([prompt], SamplingParams(allowed_token_ids=[3, 256]), use_tqdm=False)


def test_bad_words(text_llm):
    """A word of several tokens: its last token is banned where the output ends with the
    others, so greedy output turns aside exactly there; a one-token word never appears."""
    from minivllm.engine.bad_words import bad_words_token_ids

    tok = text_llm.get_tokenizer()
    prompt = "The quick brown fox"
    greedy = dict(temperature=0.0, max_tokens=30, ignore_eos=True)
    free = _ids(text_llm.generate(prompt, SamplingParams(**greedy), use_tqdm=False))[0]
    # The first output bigram whose word tokenizes back to it (with or without a space).
    for j in range(len(free) - 1):
        word = tok.decode(free[j:j + 2])
        if word.strip() and free[j:j + 2] in bad_words_token_ids(tok, [word], 49152):
            break
    else:
        pytest.fail("no output bigram round-trips through the tokenizer")
    out = text_llm.generate(prompt, SamplingParams(bad_words=[word], **greedy),
                            use_tqdm=False)[0].outputs[0].token_ids
    assert out[:j + 1] == free[:j + 1] and out[j + 1] != free[j + 1]
    assert all(out[i:i + 2] != free[j:j + 2] for i in range(len(out) - 1))
    single = next(t for t in free if len(bad_words_token_ids(tok, [tok.decode([t])],
                                                             49152)[0]) == 1)
    out = text_llm.generate(prompt, SamplingParams(bad_words=[tok.decode([single])],
                            **greedy), use_tqdm=False)[0].outputs[0].token_ids
    assert single not in out and out[:free.index(single)] == free[:free.index(single)]


def test_bad_words_need_the_tokenizer(llm):
    with pytest.raises(ValueError, match="bad_words need the tokenizer"):
        llm.generate([[5, 6]], SamplingParams(bad_words=["x"]), use_tqdm=False)


def test_detokenize_false_gives_token_ids_only(text_llm):
    params = dict(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    text = text_llm.generate("Once upon a time", SamplingParams(**params),
                             use_tqdm=False)[0].outputs[0]
    ids = text_llm.generate("Once upon a time", SamplingParams(detokenize=False, **params),
                            use_tqdm=False)[0].outputs[0]
    assert text.text and ids.text == ""
    assert ids.token_ids == text.token_ids
    assert all(lp.decoded_token is None for pos in ids.logprobs for lp in pos.values())


def test_truncate_prompt_tokens(llm):
    """The prompt's last k tokens are kept (-1: max_model_len, so a prompt longer than
    the context is cut to fill it); k past max_model_len is refused."""
    prompt = random_prompts(1, 256, 20, 20, seed=3)[0]
    params = dict(temperature=0.0, max_tokens=5, ignore_eos=True)
    cut = llm.generate([prompt], SamplingParams(truncate_prompt_tokens=6, **params),
                       use_tqdm=False)[0]
    tail = llm.generate([prompt[-6:]], SamplingParams(**params), use_tqdm=False)[0]
    assert cut.prompt_token_ids == prompt[-6:]
    assert cut.outputs[0].token_ids == tail.outputs[0].token_ids
    long = random_prompts(1, 256, 300, 300, seed=4)[0]
    full = llm.generate([long], SamplingParams(truncate_prompt_tokens=-1, **params),
                        use_tqdm=False)[0]
    assert full.prompt_token_ids == long[-256:] and len(full.outputs[0].token_ids) == 1
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        llm.generate([prompt], SamplingParams(truncate_prompt_tokens=257), use_tqdm=False)


def test_max_logprobs(tiny_model_dirs, llm):
    """max_logprobs (20 by default, as vLLM) caps logprobs and prompt_logprobs; raised,
    a step returns more than the kernels' 20, the model's own top tokens; -1 allows the
    whole vocabulary (logprobs=-1)."""
    prompt = random_prompts(1, 256, 8, 8, seed=8)[0]
    with pytest.raises(ValueError, match="max_logprobs"):
        llm.generate([prompt], SamplingParams(logprobs=21), use_tqdm=False)
    with pytest.raises(ValueError, match="max_logprobs"):
        llm.generate([prompt], SamplingParams(prompt_logprobs=-1), use_tqdm=False)
    wide = LLM(str(tiny_model_dirs["llama"]), skip_tokenizer_init=True, max_model_len=256,
               block_size=4, max_logprobs=-1)
    params = dict(temperature=0.8, seed=3, max_tokens=3, ignore_eos=True)
    out = wide.generate([prompt, prompt], [SamplingParams(logprobs=30, **params),
                        SamplingParams(logprobs=-1, prompt_logprobs=-1, **params)],
                        use_tqdm=False)
    narrow = llm.generate([prompt], SamplingParams(logprobs=20, **params),
                          use_tqdm=False)[0].outputs[0]
    thirty, every = out[0].outputs[0], out[1].outputs[0]
    assert thirty.token_ids == every.token_ids == narrow.token_ids
    for pos, top20, whole in zip(thirty.logprobs, narrow.logprobs, every.logprobs):
        assert len(pos) in (30, 31) and len(whole) == 256
        assert set(top20) <= set(pos)  # the kernels' top 20 are the first of the 30
        for t, lp in top20.items():
            assert abs(pos[t].logprob - lp.logprob) < 1e-5
            assert abs(whole[t].logprob - lp.logprob) < 1e-5
    assert all(len(p) == 256 for p in out[1].prompt_logprobs[1:])
    with pytest.raises(ValueError, match="max_logprobs"):
        LLM(str(tiny_model_dirs["llama"]), skip_tokenizer_init=True, max_logprobs=-2)


def test_repetition_penalty_past_two_and_vllm_fields(llm):
    """repetition_penalty is any finite value > 0 (vLLM's rule), and output_kind,
    extra_args and best_of == n run as the defaults."""
    prompt = [5, 6, 7, 8, 9]
    params = dict(temperature=0.0, max_tokens=20, ignore_eos=True)
    base, strong = (_ids(llm.generate([prompt], SamplingParams(
        repetition_penalty=r, **params), use_tqdm=False))[0] for r in (1.0, 6.0))
    assert base.count(base[0]) > 10 and strong.count(strong[0]) == 1
    from minivllm.sampling_params import RequestOutputKind
    same = llm.generate([prompt], SamplingParams(
        output_kind=RequestOutputKind.DELTA, extra_args={"x": 1}, best_of=1, seed=-1,
        **params), use_tqdm=False)[0].outputs[0]
    assert same.token_ids == base and same.finish_reason == "length"
