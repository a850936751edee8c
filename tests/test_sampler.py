"""The sampler on its own: Philox's mirror, the Triton kernels (interpreted) against the
PyTorch reference, the truncation against its sort-based definition, and the draws'
distributions (chi-square)."""

from types import SimpleNamespace

import pytest
import torch
import triton
import triton.language as tl

from csrc_triton import sampling as K
from minivllm import SamplingParams
from minivllm.worker import sampler as S

CPU = torch.device("cpu")


def row(i: int, prompt=(1, 2, 3, 4), output=(7, 7, 9), eos=(5,), **kw) -> SimpleNamespace:
    """What the sampler reads of a sequence."""
    params = SamplingParams(**kw)
    params._eos_token_ids = frozenset(eos)
    return SimpleNamespace(seq_id=i, params=params, num_prompt_tokens=len(prompt),
                           prompt_token_ids=list(prompt), output_token_ids=list(output),
                           plain_greedy=False)


def bitmask(allowed: list[list[int]], vocab: int) -> torch.Tensor:
    """Grammar bitmask rows (bit t % 32 of word t // 32) allowing these tokens."""
    words = torch.zeros(len(allowed), -(-vocab // 32), dtype=torch.int64)
    for r, tokens in enumerate(allowed):
        for t in tokens:
            words[r, t // 32] |= 1 << (t % 32)
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def staged(seqs, vocab: int, positions: list[int] | None = None, extras=None,
           counted=None, masks: dict[int, list[int]] | None = None
           ) -> tuple[S.SamplingState, S.RowInputs]:
    state = S.SamplingState(max(len(seqs), 1), vocab, CPU, engine_seed=0)
    slots = [state.slot_of(s) for s in seqs]
    state.flush()
    n, kx = len(seqs), 2
    extra = torch.full((n, kx), -1, dtype=torch.int32)
    for i, e in enumerate(extras or []):
        extra[i, :len(e)] = torch.tensor(e, dtype=torch.int32)
    flags = torch.tensor([1 if c else 0 for c in (counted or [True] * n)], dtype=torch.int32)
    masks = masks or {}
    for m, r in enumerate(masks):
        flags[r] |= (m + 1) << K.ROW_MASK_SHIFT
    mask = bitmask(list(masks.values()) or [[]], vocab)
    positions = positions or [s.num_prompt_tokens + len(s.output_token_ids) for s in seqs]
    return state, S.RowInputs(torch.tensor(slots, dtype=torch.int32),
                              torch.tensor(positions, dtype=torch.int64), flags, extra, mask)


NO_TAU = -2 ** 63  # csrc_triton.sampling's tau of a row whose first draw was kept
BLOCK = 32  # run_kernels' blocks: tiny vocabularies span several


def reference(logits, state, rows, want_logprobs: bool, block: int = BLOCK):
    """sample_reference with the first draw's blocks as run_kernels' kernels take them."""
    return S.sample_reference(logits, state, rows, want_logprobs, block)


def run_kernels(logits, state, rows, want_logprobs: bool, cap: int = 32, block: int = BLOCK,
                splits: int = 3, levels: int = K._LEVELS, truncating: bool = True,
                searching: bool = True):
    """csrc_triton.sampling.sample_rows (interpreted), with a small gather list and blocks
    so tiny vocabularies take every path: bounded by block maxima, the search levels, the
    one-program search; several programs a row, as on a GPU."""
    n, vocab = logits.shape
    scratch = SimpleNamespace(
        x=torch.empty(n, vocab), part=torch.empty(n * splits * 8 + 8), part_idx=torch.empty(
            n * splits + 1, dtype=torch.int32), g_val=torch.empty(n, cap),
        g_idx=torch.empty(n, cap, dtype=torch.int32), tau=torch.empty(n, dtype=torch.int64),
        block_max=torch.empty(n * -(-vocab // block)),
        block_lse=torch.empty(n * -(-vocab // block)),
        first=torch.empty(n, K.FIRST_DRAWS, dtype=torch.int64), lo=torch.empty(n, dtype=torch.int64),
        hi=torch.empty(n, dtype=torch.int64), count=torch.empty(n, dtype=torch.int32),
        search=torch.zeros(n, 6, dtype=torch.int64), search_f=torch.zeros(n, 2),
        pivots=torch.zeros(n, 16, dtype=torch.int64),
        level_count=torch.empty(n * splits * 16, dtype=torch.int32),
        level_mass=torch.empty(n * splits * 16),
        peak=torch.empty(n), lse=torch.empty(n), lists=torch.empty(4 * n, dtype=torch.int32),
        list_len=torch.zeros(4, dtype=torch.int32), list_at=torch.empty(4 * n, dtype=torch.int32),
        raw_scale=torch.empty(n))
    out = S._Outputs(n, vocab, CPU)
    out.token.fill_(-7)
    K.sample_rows(logits, logits.argmax(-1), rows, state, scratch, out, want_logprobs, block,
                  splits, levels, truncating, searching)
    out.tau = scratch.tau  # random rows' thresholds, as keys
    out.filled = int(scratch.list_len[3])  # rows whose values the fill kernel stored
    return out


MIXED = [dict(temperature=0.0), dict(temperature=0.0, repetition_penalty=1.3, logprobs=3),
         dict(temperature=0.8, top_k=50, top_p=0.9, seed=3),
         dict(temperature=1.0, seed=4),
         dict(temperature=0.7, top_p=0.5, min_p=0.05, logprobs=0),
         dict(temperature=1.2, top_k=5, logit_bias={11: 5.0, 12: -3.0}),
         dict(temperature=0.9, top_p=0.97, frequency_penalty=0.4),
         dict(temperature=0.0, min_tokens=3, frequency_penalty=0.5, presence_penalty=0.3,
              stop_token_ids=[9]),
         dict(temperature=0.6, top_k=300, top_p=0.99, seed=-5),
         dict(temperature=1.5, min_p=0.2, repetition_penalty=0.8, seed=2**40),
         dict(temperature=0.8, top_k=12, seed=9), dict(temperature=0.9, top_k=100),
         dict(temperature=1.0, top_k=380, seed=1),
         # random over every token (drawn in prepare), after a bias, bans and penalties
         dict(temperature=0.7, presence_penalty=0.5, min_tokens=5, stop_token_ids=[9],
              logit_bias={3: 2.0}, seed=11, logprobs=2)]


@pytest.mark.parametrize("shape,block,splits,levels", [
    ("peaked", 32, 3, 4), ("flat", 32, 3, 4), ("ties", 32, 3, 1), ("flat", 16, 25, 4)])
def test_kernels_match_the_reference(shape, block, splits, levels):
    """Every row of a mixed batch gets the same token, counts and logprobs from the
    kernels as from sample_reference; 'flat' rows keep more tokens than the gather list
    holds (the search's interval, a draw over the whole row), 'ties' make the search end
    on single keys; 25 splits a row take the search levels' sums more than 16 at a time;
    one search level leaves the rest of the search to the select kernel."""
    vocab = 400
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(len(MIXED), vocab, generator=g)
    logits = {"peaked": logits * 4, "flat": logits * 0.05,
              "ties": (logits * 2).round() / 2}[shape]
    seqs = [row(i, **p) for i, p in enumerate(MIXED)]
    extras = [[], [], [7, 30], [], [], [], [12], [], [], [], [], [], [], [5]]
    counted = [True] * len(seqs)
    counted[2] = counted[6] = False
    want_state, rows = staged(seqs, vocab, extras=extras, counted=counted)
    want_tokens, want_lp = reference(logits, want_state, rows, True, block)
    got_state, rows = staged(seqs, vocab, extras=extras, counted=counted)
    out = run_kernels(logits, got_state, rows, True, block=block, splits=splits,
                      levels=levels)
    assert out.token.tolist() == want_tokens.tolist()
    assert torch.equal(got_state.counts, want_state.counts)
    # The thresholds themselves (a token drawn from a kept set off at its margin can
    # still match): every truncated row's tau is the sort-based one.
    state, rows = staged(seqs, vocab, extras=extras, counted=counted)
    x, flags = S.process_logits(logits, state, rows)
    slot = rows.slot.long()
    keep = S.kept_tokens(x, flags & ~K.FLAG_MIN_P, state.ints[slot, S._I_TOP_K],
                         state.floats[slot, S._F_TOP_P], state.floats[slot, S._F_MIN_P])
    for i, p in enumerate(MIXED):
        if not (p.get("temperature") and ("top_k" in p or "top_p" in p)):
            continue
        if out.tau[i].item() == NO_TAU:  # drawn first over every token, and kept
            assert "top_k" not in p and keep[i, out.token[i]], i
        else:
            assert out.tau[i].item() == S.float_keys(x[i][keep[i]].min()).item(), i
    for i, p in enumerate(MIXED):
        if p.get("logprobs") is None:
            continue
        n = p["logprobs"]
        assert abs(out.token_lp[i].item() - want_lp[0][i].item()) < 1e-5
        assert out.rank[i].item() == want_lp[1][i].item()
        assert out.top_idx[i, :n].tolist() == want_lp[3][i, :n].tolist()
        torch.testing.assert_close(out.top_val[i, :n], want_lp[2][i, :n])


def kernels_match_reference(seqs, logits, want_logprobs: bool, **launch):
    """The kernels (run_kernels with `launch`'s switches) on freshly staged rows give the
    reference's tokens and token counts; returns their outputs and the reference's
    logprobs."""
    want_state, rows = staged(seqs, logits.shape[1])
    want, want_lp = reference(logits, want_state, rows, want_logprobs,
                              launch.get("block", BLOCK))
    got_state, rows = staged(seqs, logits.shape[1])
    out = run_kernels(logits, got_state, rows, want_logprobs, **launch)
    assert out.token.tolist() == want.tolist()
    assert torch.equal(got_state.counts, want_state.counts)
    return out, want_lp


def test_a_batch_without_truncation_skips_the_truncation_kernels():
    """Greedy, penalized, biased and temperature-only rows: the sampler stages them as a
    batch without top-k, top-p or min-p, and the kernels launched without the
    truncation ones (check, bound, fill, levels, gather, draw) give the reference's tokens,
    counts and logprobs."""
    vocab = 400
    plain = [p for p in MIXED if not {"top_k", "top_p", "min_p"} & set(p)]
    assert len(plain) >= 5
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(len(plain), vocab, generator=g) * 2
    seqs = [row(i, **p) for i, p in enumerate(plain)]
    out, want_lp = kernels_match_reference(seqs, logits, True, truncating=False)
    for i, p in enumerate(plain):
        if p.get("logprobs"):
            assert abs(out.token_lp[i].item() - want_lp[0][i].item()) < 1e-5
    sampler = S.Sampler(vocab, CPU, max_rows=8, num_slots=8)
    sampler.stage(seqs, [10] * len(seqs))
    assert not sampler.truncating
    sampler.stage(seqs + [row(9, temperature=0.7, min_p=0.1)], [10] * (len(seqs) + 1))
    assert sampler.truncating


def test_a_min_p_batch_skips_the_threshold_search():
    """Min-p rows (with greedy, penalized and temperature-only ones, no top-k or top-p):
    the sampler stages them as a batch that needs no threshold search, and the kernels
    launched without check, the search levels and gather give the reference's tokens,
    first draws cut by min-p included."""
    vocab = 400
    params = [dict(temperature=0.0), dict(temperature=0.0, repetition_penalty=1.3),
              dict(temperature=1.0, seed=4)]
    params += [dict(temperature=0.6 + 0.1 * (i % 5), min_p=0.3, seed=i,
                    **(dict(frequency_penalty=0.4) if i % 4 == 0 else {})) for i in range(13)]
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(len(params), vocab, generator=g) * 3
    seqs = [row(i, **p) for i, p in enumerate(params)]
    out, _ = kernels_match_reference(seqs, logits, False, searching=False)
    assert out.filled > 0  # some first draws were cut, and drawn again
    sampler = S.Sampler(vocab, CPU, max_rows=len(seqs) + 1, num_slots=len(seqs) + 1)
    sampler.stage(seqs, [10] * len(seqs))
    assert sampler.truncating and not sampler.searching
    sampler.stage(seqs + [row(99, temperature=0.7, top_p=0.9)], [10] * (len(seqs) + 1))
    assert sampler.searching


def test_top_p_rows_are_drawn_first_and_searched_only_when_the_draw_is_cut():
    """A top-p (or min-p) row without top-k is drawn over every token first, up to
    FIRST_DRAWS times; the first kept token stands, and a row with none kept searches for
    tau and draws from the kept set. At top_p 0.5 both happen in one batch; every token is
    the reference's."""
    vocab, n = 400, 24
    for scale in (0.05, 3.0):
        g = torch.Generator().manual_seed(11)
        logits = torch.randn(n, vocab, generator=g) * scale
        seqs = [row(i, temperature=0.9, top_p=0.5, seed=i, **(dict(min_p=0.3) if i % 3 == 0
                                                              else {}))
                for i in range(n)]
        want, _ = reference(logits, *staged(seqs, vocab), False)
        out = run_kernels(logits, *staged(seqs, vocab), False)
        assert out.token.tolist() == want.tolist(), scale
        first = out.tau == NO_TAU
        assert 0 < int(first.sum()) < n, scale  # kept first draws, and searched rows
        # Their values are the logits / temperature: prepare stored none, and the fill
        # kernel stored those of the rows whose draw was cut.
        assert out.filled == n - int(first.sum()), scale
        if scale == 3.0:  # some rows drew their top token: kept without the check's pass
            assert (out.token == logits.argmax(-1)).any()


def test_top_p_after_a_top_k_cut_takes_top_ks_mass():
    """Rows with top-k (within the blocks' bound) and top-p, on logits whose top-p bound
    from the block maxima lies above top-k's: top-p's share is of the mass top-k kept, not
    the row's, so the kernels must gather top-k's whole set (the 64 and 256-row GPU runs
    at 151,936 tokens drew outside the reference's set before)."""
    vocab, n = 400, 16
    # Of seeds 0-9, these give rows where the rule matters: without it, one row of each
    # drew outside the reference's set (the other seeds never did).
    for seed in (4, 5, 8):
        g = torch.Generator().manual_seed(seed)
        logits = torch.randn(n, vocab, generator=g) * (2.5 + 0.5 * (seed % 2))
        seqs = [row(i, temperature=0.7, top_k=10, top_p=0.8, seed=i) for i in range(n)]
        want, _ = reference(logits, *staged(seqs, vocab), False)
        out = run_kernels(logits, *staged(seqs, vocab), False)
        assert out.token.tolist() == want.tolist(), seed


def test_grammar_masks_in_kernels_and_reference():
    """Rows with a grammar's bitmask (greedy, random, truncated, penalized) draw only
    allowed tokens, the kernels as the reference; a grammar row without a mask this step
    and rows without a grammar are untouched (the same draws as with no masks at all)."""
    vocab = 400
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, vocab, generator=g) * 3
    grammar = dict(structured_outputs={"choice": ["a"]})
    settings = [dict(temperature=0.0, **grammar), dict(temperature=0.9, seed=1, **grammar),
                dict(temperature=0.8, top_k=40, top_p=0.9, seed=2, **grammar),
                dict(temperature=0.0, repetition_penalty=1.3, **grammar),
                dict(temperature=1.0, seed=5, **grammar), dict(temperature=0.7, seed=6)]
    seqs = [row(i, **p) for i, p in enumerate(settings)]
    masks = {0: [5, 17, 399], 1: list(range(0, 400, 7)), 2: [33, 64, 65, 200],
             3: [7, 8, 9]}
    want_state, rows = staged(seqs, vocab, masks=masks)
    want, _ = reference(logits, want_state, rows, False)
    got_state, rows = staged(seqs, vocab, masks=masks)
    got = run_kernels(logits, got_state, rows, False).token
    assert got.tolist() == want.tolist()
    for r, allowed in masks.items():
        assert want[r].item() in allowed
        best = max(allowed, key=lambda t: logits[r, t].item())
        if settings[r]["temperature"] == 0.0 and "repetition_penalty" not in settings[r]:
            assert want[r].item() == best
    free_state, free_rows = staged(seqs, vocab)
    free, _ = reference(logits, free_state, free_rows, False)
    assert want[4:].tolist() == free[4:].tolist()


def test_allowed_tokens_and_word_bans_in_kernels_and_reference():
    """allowed_token_ids (the slot's bias row at -inf but for them, logit_bias on top) and
    one-token bad words (-inf in the bias row): rows greedy, random, truncated, penalized
    draw only allowed, unbanned tokens, the kernels as the reference."""
    vocab = 400
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(5, vocab, generator=g) * 3
    allowed = [5, 17, 33, 64, 399]
    settings = [dict(temperature=0.0, allowed_token_ids=allowed),
                dict(temperature=0.9, seed=1, allowed_token_ids=allowed),
                dict(temperature=0.8, top_k=3, top_p=0.9, seed=2, allowed_token_ids=allowed,
                     logit_bias={33: 4.0, 100: 50.0}),
                dict(temperature=0.0, repetition_penalty=1.3, allowed_token_ids=[7, 8, 9]),
                dict(temperature=0.0)]
    seqs = [row(i, **p) for i, p in enumerate(settings)]
    free, _ = reference(logits, *staged(seqs, vocab), False)
    seqs[4].params._bad_words_token_ids = [[free[4].item()], [3, 4]]  # the one-token word
    want_state, rows = staged(seqs, vocab)
    want, _ = reference(logits, want_state, rows, False)
    got_state, rows = staged(seqs, vocab)
    assert torch.isinf(got_state.bias[0]).sum().item() == vocab - len(allowed)
    got = run_kernels(logits, got_state, rows, False).token
    assert got.tolist() == want.tolist()
    for r in range(3):
        assert want[r].item() in allowed
    assert want[0].item() == max(allowed, key=lambda t: logits[0, t].item())
    assert want[3].item() in (7, 8, 9)
    assert want[4].item() != free[4].item()
    assert want[4].item() == logits[4].topk(2).indices[1].item()


@triton.jit
def _uniforms_kernel(seed_ptr, pos_ptr, out_ptr, block_out_ptr, V: tl.constexpr,
                     STREAM: tl.constexpr):
    r = tl.program_id(0)
    tokens = tl.arange(0, V)
    seed, position = tl.load(seed_ptr + r), tl.load(pos_ptr + r)
    tl.store(out_ptr + r * V + tokens, K._uniform(seed, tokens, position, STREAM))
    tl.store(block_out_ptr + r * V + tokens, K._uniform_block(seed, 0, position, V, STREAM))


def test_philox_mirror_is_bit_exact():
    """worker/sampler.py's Philox in PyTorch gives the kernels' uniforms bit for bit, for
    any seed (negative and above 32 bits too), token, position and stream; the streams'
    numbers differ."""
    seeds = torch.tensor([0, 1, -1, 12345, 2**40 + 17, -(2**62)], dtype=torch.int64)
    positions = torch.tensor([0, 5, 70000, 3, 2**31 - 1, 9], dtype=torch.int64)
    streams = {}
    for stream in (0, 2):
        got, block = torch.empty(6, 64), torch.empty(6, 64)
        _uniforms_kernel[(6,)](seeds, positions, got, block, V=64, STREAM=stream)
        assert torch.equal(block, got)  # the draw kernel's four tokens a Philox call
        want = S.philox_uniform(seeds[:, None], torch.arange(64).expand(6, 64),
                                positions[:, None], stream)
        assert torch.equal(got, want)
        assert 0.0 < want.min() and want.max() < 1.0
        assert len(set(want[0].tolist())) == 64
        streams[stream] = want
    assert not torch.isin(streams[0], streams[2]).any()


def sort_based_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                     min_p: float) -> torch.Tensor:
    """The truncated distribution by sorting the whole vocabulary (the definition the
    sampler's search must meet exactly): softmax of logits / temperature, keep the top_k
    largest, then in descending order each token whose preceding mass is under top_p (a
    token tied with the last kept one is kept too), then those with p >= min_p * max."""
    x = logits.double() / temperature
    values, order = x.sort(descending=True)
    keep = torch.ones_like(values, dtype=torch.bool)
    if 0 < top_k < len(values):
        keep &= values >= values[top_k - 1]
    if top_p < 1.0:
        p = torch.softmax(values.masked_fill(~keep, float("-inf")), 0)
        before = p.cumsum(0) - p
        last = int(torch.nonzero(keep & (before < top_p)).max())
        keep &= values >= values[last]
    if min_p > 0:
        keep &= torch.exp(values - values[0]) >= min_p
    probs = torch.zeros_like(x)
    probs[order[keep]] = torch.softmax(values[keep], 0)
    return probs


# chi2 quantiles at p = 0.9999 by degrees of freedom (a false failure 1 run in 10,000)
CHI2_9999 = {1: 15.14, 2: 18.42, 3: 21.11, 4: 23.51, 5: 25.74, 6: 27.86, 7: 29.88,
             8: 31.83, 9: 33.72, 10: 35.56, 11: 37.37, 12: 39.13, 13: 40.87}


def chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    observed = torch.bincount(tokens, minlength=len(probs)).double()
    support = probs > 0
    assert observed[~support].sum() == 0, "a token outside the kept set was drawn"
    expected = probs[support] * tokens.numel()
    return float(((observed[support] - expected) ** 2 / expected).sum()), int(support.sum()) - 1


@pytest.mark.parametrize("cfg", [
    dict(temperature=1.0), dict(temperature=0.6), dict(temperature=1.0, top_k=4),
    dict(temperature=1.0, top_p=0.7), dict(temperature=1.0, min_p=0.15),
    dict(temperature=0.8, top_k=6, top_p=0.8), dict(temperature=1.3, top_p=0.9, min_p=0.1),
    dict(temperature=0.7, top_k=5, top_p=0.95, min_p=0.05)])
def test_draws_follow_the_sort_based_distribution(cfg):
    """30,000 rows, each its own seed, one 12-token logits row: the tokens drawn follow
    the sort-based truncated softmax (chi-square at p = 0.9999)."""
    vocab, n = 12, 30_000
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(1)) * 1.5
    want = sort_based_probs(logits, cfg["temperature"], cfg.get("top_k", 0),
                            cfg.get("top_p", 1.0), cfg.get("min_p", 0.0))
    sampler = S.Sampler(vocab, CPU, seed=3, max_rows=n, num_slots=n)
    seqs = [row(i, seed=i, **cfg) for i in range(n)]
    out = sampler.sample_now(logits.expand(n, vocab).clone(), None, seqs, [4] * n)
    stat, dof = chi_square(torch.tensor(out.token_ids), want)
    assert dof >= 1 and stat < CHI2_9999[dof], (stat, dof, want)


@pytest.mark.parametrize("cfg", [
    dict(temperature=1.0), dict(temperature=0.7, top_p=0.6), dict(temperature=1.0, min_p=0.2),
    dict(temperature=1.2, top_p=0.8, min_p=0.05)])
def test_first_draws_in_blocks_follow_the_sort_based_distribution(cfg):
    """The first draw's two stages (a block by its mass, then a token of it) over 5
    blocks of 4 tokens, one of them all banned and one cut short by the vocabulary's end,
    kept or drawn again when cut: 30,000 seeded rows follow the sort-based truncated
    softmax (chi-square at p = 0.9999)."""
    vocab, n = 18, 30_000
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(2)) * 1.5
    ban = list(range(8, 12))  # the third block
    allowed = [t for t in range(vocab) if t not in ban]
    seqs = [row(i, seed=i, allowed_token_ids=allowed, **cfg) for i in range(n)]
    state, rows = staged(seqs, vocab, positions=[4] * n)
    tokens, _ = S.sample_reference(logits.expand(n, vocab).clone(), state, rows, False,
                                   block=4)
    masked = logits.clone()
    masked[ban] = -float("inf")
    want = sort_based_probs(masked, cfg["temperature"], 0, cfg.get("top_p", 1.0),
                            cfg.get("min_p", 0.0))
    stat, dof = chi_square(tokens, want)
    assert dof >= 1 and stat < CHI2_9999[dof], (stat, dof, want)


def test_kept_set_is_the_sort_based_one():
    """On rows with ties at the boundaries and random ones, the reference's kept set is
    the sort-based definition's support."""
    g = torch.Generator().manual_seed(5)
    cases = []
    for _ in range(60):
        logits = (torch.randn(40, generator=g) * 2).round() / 2  # many ties
        k = int(torch.randint(0, 45, (1,), generator=g))
        p = float(torch.rand(1, generator=g)) * 0.99 + 0.01
        m = float(torch.rand(1, generator=g)) * 0.3
        cases.append((logits, 0.9, k, p, m))
    for logits, t, k, p, m in cases:
        params = SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m)
        flags = torch.tensor([S.slot_flags(params)])
        if not 0 < k < 40:
            flags &= ~S.FLAG_TOP_K
        x = (logits / t)[None]
        keep = S.kept_tokens(x, flags, torch.tensor([k]), torch.tensor([p]), torch.tensor([m]))
        want = sort_based_probs(logits, t, k, p, m) > 0
        assert torch.equal(keep[0], want), (logits, k, p, m)


def test_counts_hold_prompt_output_and_bans():
    """A slot's counts: the prompt's presence, the output's counts (a resumed sequence's
    tokens so far), min_tokens' bans (EOS and stop tokens), and each draw adds its token."""
    seq = row(0, prompt=(3, 3, 8), output=(8, 9, 9, -1), eos=(2,), temperature=0.0,
              repetition_penalty=1.2, min_tokens=9, stop_token_ids=[6])
    state, rows = staged([seq], 16, positions=[7])
    c = state.counts[0]
    assert c[3].item() == S.PROMPT_BIT and c[8].item() == S.PROMPT_BIT + 4
    assert c[9].item() == 8 and c[2].item() == S.BAN_BIT and c[6].item() == S.BAN_BIT
    logits = torch.zeros(1, 16)
    logits[0, 2] = logits[0, 6] = 50.0  # banned: not drawn before min_tokens
    logits[0, 11] = 1.0
    tokens, _ = reference(logits, state, rows, False)
    assert tokens.tolist() == [11] and c[11].item() == 4


def test_kernels_that_fail_their_check_leave_the_reference(monkeypatch, caplog):
    """A sampler whose kernels raise (or disagree) in the start-up check samples with the
    PyTorch reference instead, and says so."""
    sampler = S.Sampler(500, CPU, max_rows=4, num_slots=4)

    def broken(self, *args, **kwargs):
        raise RuntimeError("no such kernel")

    monkeypatch.setattr(S.Sampler, "sample_now", broken)
    with caplog.at_level("WARNING", logger="minivllm.worker.sampler"):
        assert sampler.check_kernels() is False
    assert sampler.kernels is False and "PyTorch ops instead" in caplog.text



def test_staging_looks_slots_up_again_after_a_release():
    """stage keeps the last batch's slots while the same sequences come back in order; a
    release forgets them: a released sequence staged again is admitted again (its state
    written to a slot the sampler holds for it), and one re-admitted after its slot went
    to another gets a slot of its own, with its own parameters."""
    vocab = 64
    sampler = S.Sampler(vocab, CPU, max_rows=4, num_slots=2)
    a, b, c = (row(i, temperature=0.5 + i, seed=i) for i in range(3))
    sampler.stage([a, b], [4, 4])
    sampler.stage([a, b], [5, 5])  # the same batch: the same slots
    slot_a, slot_b = sampler.rows.slot[:2].tolist()
    sampler.release(a)
    sampler.stage([a, b], [6, 6])  # the same batch, but a was released
    assert a.seq_id in sampler.state._slots
    sampler.release(a)
    sampler.stage([c], [4])  # c takes a's slot
    assert sampler.rows.slot[0].item() == slot_a
    sampler.release(b)
    sampler.stage([a, c], [6, 5])
    got = sampler.rows.slot[:2].tolist()
    assert got[1] == slot_a and got[0] == slot_b  # a back, in the slot b left
    temperature = sampler.state.floats[:, 0]
    assert temperature[got[0]].item() == pytest.approx(0.5)
    assert temperature[got[1]].item() == pytest.approx(2.5)
