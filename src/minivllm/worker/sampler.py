"""Batched sampling: one set of tensor ops for every row, greedy and random alike.

Order per row: raw log-probabilities (reported logprobs are of the model's own
distribution) -> bans (min_tokens) -> penalties -> greedy argmax, or temperature, top-k,
top-p, min-p and an exponential race (argmax of p / q with q ~ Exp(1), which draws from
p). A seeded row draws its q from its own generator, so its tokens do not depend on what
else is in the batch.

Speculative rows (a draft token d proposed at that position) are verified by rejection
sampling: d is kept with probability min(1, p(d) / q(d)), where q is the proposer's
distribution (one-hot at d for n-gram lookup, so the test is u < p(d)); otherwise the row
draws from max(0, p - q), renormalized. The engine keeps the rows up to the first one whose
token differs from its draft, so the tokens it appends are distributed as p alone would
give them. Greedy rows need no test: the engine compares their argmax with the draft.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ..sampling_params import SamplingParams


class SamplingRow(Protocol):
    """What the sampler reads about one row of logits (an engine Sequence provides it;
    the sampler takes the sequences themselves, so nothing is copied per step)."""

    params: SamplingParams
    generator: torch.Generator | None

    @property
    def prompt_token_ids(self) -> list[int]: ...

    @property
    def output_token_ids(self) -> list[int]: ...

    @property
    def num_output_tokens(self) -> int: ...


def argmax_rows(logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """logits.argmax(dim=-1) of [rows, vocab] logits, the first index of each row's maximum
    (into `out` when given). A long row on a GPU goes to csrc_triton.argmax_rows (two
    stages, launched early; not inside torch.compile): torch's argmax takes one thread
    block a row, 28 us for Llama-3.1-8B's 128,256 logits at batch 1 on the H200
    (docs/decisions.md)."""
    if (logits.is_cuda and logits.shape[-1] >= 16384 and logits.stride(-1) == 1
            and not torch.compiler.is_compiling()):
        from csrc_triton import argmax_rows as argmax_kernel
        return argmax_kernel(logits, out)
    if out is None:
        return logits.argmax(dim=-1)
    return torch.argmax(logits, dim=-1, out=out)


def _before_min_tokens(row: SamplingRow) -> bool:
    """Whether the row's EOS and stop tokens are still banned (min_tokens not reached)."""
    return bool(row.params.min_tokens and row.num_output_tokens < row.params.min_tokens)


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # Per row, when logprobs were asked for: (logprob of the sampled token, its rank,
    # top-N ids, top-N logprobs); None otherwise.
    logprobs: list[tuple[float, int, list[int], list[float]] | None]


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device, seed: int = 0) -> None:
        self.vocab_size = vocab_size
        self.device = device
        # Unseeded rows draw from the engine's own generator: reproducible per engine seed.
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow],
                 greedy_tokens: torch.Tensor | None = None,
                 drafts: list[int] | None = None,
                 draft_probs: torch.Tensor | None = None) -> SamplerOutput:
        """greedy_tokens: argmax of these logits if the caller already has it (the
        decode graph computes it); used when nothing below changes the logits.
        drafts: per row, the draft token proposed at that position (-1: none);
        draft_probs: the proposer's distribution per row (None: one-hot at the draft).
        logits may be in the model's dtype: they are read in fp32."""
        want_logprobs = [r.params.logprobs is not None for r in rows]
        raw_logprobs = (torch.log_softmax(logits.float(), dim=-1) if any(want_logprobs)
                        else None)
        sampled = self._sample(logits, rows, greedy_tokens, drafts, draft_probs)
        token_ids = sampled.tolist()
        lp_out: list = [None] * logits.shape[0]
        if raw_logprobs is not None:
            lp_out = self._gather_logprobs(raw_logprobs, sampled, rows, want_logprobs)
        return SamplerOutput(token_ids, lp_out)

    def sample_on_device(self, logits: torch.Tensor, rows: list[SamplingRow],
                         greedy_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """The sampled ids as a device tensor, without waiting for them (pipelined
        decoding; rows must not ask for logprobs)."""
        return self._sample(logits, rows, greedy_tokens)

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow],
                greedy_tokens: torch.Tensor | None, drafts: list[int] | None = None,
                draft_probs: torch.Tensor | None = None) -> torch.Tensor:
        greedy = [r.params.greedy for r in rows]
        if (all(greedy) and greedy_tokens is not None
                and not any(self._may_edit(r) for r in rows)):
            return greedy_tokens  # the logits are not read: no fp32 copy of them
        logits = logits.float()  # a copy unless they are fp32 already: edited in place below
        changed = self._apply_bans(logits, rows)
        changed |= self._apply_penalties(logits, rows)
        if all(greedy):
            if greedy_tokens is not None and not changed:
                return greedy_tokens
            return argmax_rows(logits)
        return self._sample_random(logits, rows, greedy, drafts, draft_probs)

    @staticmethod
    def _may_edit(row: SamplingRow) -> bool:
        """Whether _apply_bans or _apply_penalties may change this row's logits (true
        whenever they would)."""
        p = row.params
        return bool(p.logit_bias or p.has_penalties or _before_min_tokens(row))

    # ---- steps --------------------------------------------------------------------------

    def _apply_bans(self, logits: torch.Tensor, rows: list[SamplingRow]) -> bool:
        """logit_bias, and min_tokens: EOS and stop tokens cannot be drawn before then
        (in place)."""
        changed = False
        for i, r in enumerate(rows):
            p = r.params
            if p.logit_bias:
                ids = torch.tensor(list(p.logit_bias), device=logits.device)
                bias = torch.tensor(list(p.logit_bias.values()), device=logits.device)
                logits[i, ids] += bias
                changed = True
            if _before_min_tokens(r):
                banned = set(p.stop_token_ids) | set(p._eos_token_ids)
                banned = [t for t in banned if t < self.vocab_size]
                if banned:
                    logits[i, banned] = float("-inf")
                    changed = True
        return changed

    def _apply_penalties(self, logits: torch.Tensor, rows: list[SamplingRow]) -> bool:
        """Repetition, frequency and presence penalties (in place)."""
        idx = [i for i, r in enumerate(rows) if r.params.has_penalties]
        if not idx:
            return False
        vocab, dev = self.vocab_size, logits.device
        sub = logits[idx]
        out_counts = _token_counts([rows[i].output_token_ids for i in idx], vocab, dev)
        prompt_seen = _token_counts([rows[i].prompt_token_ids for i in idx], vocab, dev) > 0
        rep = torch.tensor([rows[i].params.repetition_penalty for i in idx], device=dev)[:, None]
        freq = torch.tensor([rows[i].params.frequency_penalty for i in idx], device=dev)[:, None]
        pres = torch.tensor([rows[i].params.presence_penalty for i in idx], device=dev)[:, None]
        seen = prompt_seen | (out_counts > 0)
        # Repetition penalty (CTRL): shrink positive logits, push negative ones further down.
        penalized = torch.where(sub > 0, sub / rep, sub * rep)
        sub = torch.where(seen, penalized, sub)
        sub = sub - freq * out_counts - pres * (out_counts > 0).float()
        logits[idx] = sub
        return True

    def _sample_random(self, logits: torch.Tensor, rows: list[SamplingRow],
                       greedy: list[bool], drafts: list[int] | None = None,
                       draft_probs: torch.Tensor | None = None) -> torch.Tensor:
        greedy_t = torch.tensor(greedy, device=logits.device)
        greedy_tokens = argmax_rows(logits)
        probs = self._probs(logits, rows, greedy)
        sampled = self._race(probs, rows)
        if drafts is not None:
            tested = [i for i, (d, g) in enumerate(zip(drafts, greedy)) if d >= 0 and not g]
            if tested:
                self._test_drafts(probs, rows, sampled, drafts, draft_probs, tested)
        return torch.where(greedy_t, greedy_tokens, sampled)

    def _probs(self, logits: torch.Tensor, rows: list[SamplingRow],
                greedy: list[bool]) -> torch.Tensor:
        """Each row's distribution after temperature, top-k, top-p and min-p (normalized;
        greedy rows get temperature 1 and are not drawn from)."""
        dev = logits.device
        temps = torch.tensor([1.0 if g else r.params.temperature for r, g in zip(rows, greedy)],
                             device=dev)
        logits = logits / temps[:, None]
        top_k = [r.params.top_k for r in rows]
        top_p = [r.params.top_p for r in rows]
        if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
            logits = _top_k_top_p(logits, top_k, top_p)
        probs = torch.softmax(logits, dim=-1)
        min_p = [r.params.min_p for r in rows]
        if any(m > 0 for m in min_p):
            thresh = torch.tensor(min_p, device=dev)[:, None] * probs.amax(dim=-1, keepdim=True)
            probs = torch.where(probs < thresh, torch.zeros_like(probs), probs)
            probs /= probs.sum(dim=-1, keepdim=True)
        return probs

    def propose(self, logits: torch.Tensor, rows: list[SamplingRow],
                ) -> tuple[list[int], torch.Tensor | None]:
        """A draft model's tokens: each row's argmax (greedy) or a draw from its processed
        distribution, and those distributions (None when every row is greedy), which the
        target's rejection test divides by."""
        logits = logits.float()
        self._apply_bans(logits, rows)
        greedy = [r.params.greedy for r in rows]
        if all(greedy):
            return argmax_rows(logits).tolist(), None
        probs = self._probs(logits, rows, greedy)
        tokens = torch.where(torch.tensor(greedy, device=logits.device),
                             argmax_rows(logits), self._race(probs, rows))
        return tokens.tolist(), probs

    def _draw(self, out: torch.Tensor, rows: list[SamplingRow], kind: str) -> torch.Tensor:
        """Fill out (one row per entry of rows) with Exp(1) or U(0, 1) draws: a seeded row
        from its own generator, the rest from the engine's."""
        def fill(t: torch.Tensor, gen: torch.Generator) -> None:
            t.exponential_(generator=gen) if kind == "exp" else t.uniform_(generator=gen)

        unseeded = [i for i, r in enumerate(rows) if r.generator is None]
        if len(unseeded) == len(rows):
            fill(out, self.generator)
        elif unseeded:
            rest = torch.empty((len(unseeded),) + out.shape[1:], device=out.device)
            fill(rest, self.generator)
            out[unseeded] = rest
        for i, r in enumerate(rows):
            if r.generator is not None:
                fill(out[i], r.generator)
        return out

    def _race(self, probs: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """One draw per row from probs: argmax of p / q with q ~ Exp(1)."""
        return (probs / self._draw(torch.empty_like(probs), rows, "exp")).argmax(dim=-1)

    def _test_drafts(self, probs: torch.Tensor, rows: list[SamplingRow],
                     sampled: torch.Tensor, drafts: list[int],
                     draft_probs: torch.Tensor | None, tested: list[int]) -> None:
        """Rejection sampling of the tested rows' drafts (in place in sampled)."""
        dev = probs.device
        sub_rows = [rows[i] for i in tested]
        idx = torch.tensor(tested, device=dev)
        d = torch.tensor([drafts[i] for i in tested], device=dev)
        p = probs[idx]
        p_d = p.gather(1, d[:, None])[:, 0]
        if draft_probs is None:
            q_d = torch.ones_like(p_d)
            residual = p.scatter(1, d[:, None], 0.0)
        else:
            q = draft_probs[idx].float()
            q_d = q.gather(1, d[:, None])[:, 0]
            residual = (p - q).clamp_min_(0.0)
        u = self._draw(torch.empty(len(tested), device=dev), sub_rows, "uniform")
        accept = u * q_d < p_d
        # A rejected draft has p(d) < q(d), so the residual is zero at d and has mass left.
        fallback = self._race(residual, sub_rows)
        sampled[idx] = torch.where(accept, d, fallback)

    def _gather_logprobs(self, raw: torch.Tensor, sampled: torch.Tensor,
                         rows: list[SamplingRow], want: list[bool]) -> list:
        idx = [i for i, w in enumerate(want) if w]
        sub = raw[idx]
        tok = sampled[idx]
        tok_lp = sub.gather(1, tok[:, None])
        ranks = (sub > tok_lp).sum(dim=-1) + 1
        max_n = max(rows[i].params.logprobs for i in idx)
        if max_n > 0:
            top_vals, top_ids = sub.topk(max_n, dim=-1)
            top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
        tok_lp, ranks = tok_lp[:, 0].tolist(), ranks.tolist()
        out: list = [None] * len(rows)
        for j, i in enumerate(idx):
            n = rows[i].params.logprobs
            ids = top_ids[j][:n] if n else []
            vals = top_vals[j][:n] if n else []
            out[i] = (tok_lp[j], ranks[j], ids, vals)
        return out


def _token_counts(seqs: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    width = max((len(s) for s in seqs), default=0)
    counts = torch.zeros(len(seqs), vocab + 1, device=device)
    if width == 0:
        return counts[:, :vocab]
    padded = torch.full((len(seqs), width), vocab, dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            padded[i, :len(s)] = torch.tensor(s, dtype=torch.long)
    padded = padded.to(device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=counts.dtype))
    return counts[:, :vocab]


def _top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    dev = logits.device
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=dev)[None, :]
    k = torch.tensor([kk if kk > 0 else vocab for kk in top_k], device=dev)[:, None]
    mask = ranks >= k
    p = torch.tensor(top_p, device=dev)[:, None]
    probs = torch.softmax(sorted_logits.masked_fill(mask, float("-inf")), dim=-1)
    # Drop a token once the mass before it already reaches top_p (the first always stays).
    mass_before = probs.cumsum(dim=-1) - probs
    mask |= mass_before >= p
    sorted_logits = sorted_logits.masked_fill(mask, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
