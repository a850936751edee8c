"""Batched sampling: one set of tensor ops for every row, greedy and random alike.

Order per row: raw log-probabilities (reported logprobs are of the model's own
distribution) -> bans (min_tokens) -> penalties -> greedy argmax, or temperature, top-k,
top-p, min-p and an exponential race (argmax of p / q with q ~ Exp(1), which draws from
p). A seeded row draws its q from its own generator, so its tokens do not depend on what
else is in the batch.
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
                 greedy_tokens: torch.Tensor | None = None) -> SamplerOutput:
        """greedy_tokens: argmax of these logits if the caller already has it (the
        decode graph computes it); used when nothing below changes the logits."""
        logits = logits.float()
        want_logprobs = [r.params.logprobs is not None for r in rows]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_logprobs) else None
        sampled = self._sample(logits, rows, greedy_tokens)
        token_ids = sampled.tolist()
        lp_out: list = [None] * logits.shape[0]
        if raw_logprobs is not None:
            lp_out = self._gather_logprobs(raw_logprobs, sampled, rows, want_logprobs)
        return SamplerOutput(token_ids, lp_out)

    def sample_on_device(self, logits: torch.Tensor, rows: list[SamplingRow],
                         greedy_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """The sampled ids as a device tensor, without waiting for them (pipelined
        decoding; rows must not ask for logprobs)."""
        return self._sample(logits.float(), rows, greedy_tokens)

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow],
                greedy_tokens: torch.Tensor | None) -> torch.Tensor:
        changed = self._apply_bans(logits, rows)
        changed |= self._apply_penalties(logits, rows)
        greedy = [r.params.greedy for r in rows]
        if all(greedy):
            if greedy_tokens is not None and not changed:
                return greedy_tokens
            return logits.argmax(dim=-1)
        return self._sample_random(logits, rows, greedy)

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
            if p.min_tokens and r.num_output_tokens < p.min_tokens:
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
                       greedy: list[bool]) -> torch.Tensor:
        dev = logits.device
        greedy_t = torch.tensor(greedy, device=dev)
        greedy_tokens = logits.argmax(dim=-1)
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

        q = torch.empty_like(probs)
        unseeded = [i for i, r in enumerate(rows) if r.generator is None]
        if unseeded:
            if len(unseeded) == len(rows):
                q.exponential_(generator=self.generator)
            else:
                q_rest = torch.empty(len(unseeded), probs.shape[1], device=dev)
                q[unseeded] = q_rest.exponential_(generator=self.generator)
        for i, r in enumerate(rows):
            if r.generator is not None:
                q[i].exponential_(generator=r.generator)
        sampled = (probs / q).argmax(dim=-1)
        return torch.where(greedy_t, greedy_tokens, sampled)

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
