"""Batched sampling on the device, one row of logits per sampled token.

Per row, in order (vLLM's): a grammar's token mask, logit_bias, min_tokens' bans (EOS and
stop tokens), the repetition / frequency / presence penalties, then for a random row temperature, top-k,
top-p and min-p, and a draw. Reported logprobs are the raw logits' (the model's own
distribution), top-N up to 20.

Each running sequence owns a *slot* (SamplingState): its parameters, its token counts
(prompt presence, output counts, bans) and its bias live in device tensors written once
when it is admitted; each step's draw adds its token to the counts on the device, so
nothing per step depends on the host knowing earlier tokens: sampled rows, penalized
rows and rows with logprobs are all pipelined like greedy ones.

The draw is the Gumbel-max one: argmax over the kept tokens of x_i - log(-log(u_i)),
u_i from Philox keyed on the row's seed and counter (token, position); a row without
top-k first draws in two stages, a block of tokens and then a token of it (first_draws),
up to FIRST_DRAWS times for top-p or min-p, and keeps the first kept token: a seeded request
draws the same tokens alone or in any batch, eagerly or in a graph, before or after a
preemption, with or without speculative decoding (a draft is kept iff the target's draw
at its position equals it). Unseeded rows key on the engine seed and the sequence.

On a GPU the rows go through csrc_triton.sampling's kernels (replayed as CUDA graphs per
row bucket, see SamplerGraphs); on a CPU through `sample_reference`, the same arithmetic
in PyTorch (the thresholds by sorting), which the tests hold the kernels to.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from csrc_triton.sampling import (BAN_BIT, COUNT_SHIFT, DRAW_BLOCK, FIRST_DRAWS, FLAG_BANS,
                                  FLAG_BIAS, FLAG_GRAMMAR,
                                  FLAG_LOGPROBS, FLAG_MIN_P, FLAG_PENALTY, FLAG_RANDOM,
                                  FLAG_TOP_K, FLAG_TOP_P, MAX_LOGPROBS, PROMPT_BIT,
                                  ROW_MASK_SHIFT, ROW_UPDATE_COUNTS)

from ..engine.bad_words import has_sequences, single_token_bans

# Slot parameter columns (csrc_triton/sampling.py reads them by these positions).
_I_FLAGS, _I_TOP_K, _I_SEED, _I_PROMPT_LEN, _I_MIN_TOKENS, _I_LOGPROBS = range(6)
_F_TEMPERATURE, _F_TOP_P, _F_MIN_P, _F_REP, _F_FREQ, _F_PRES, _F_INV_TEMPERATURE = range(7)
_U32 = 0xFFFFFFFF
_TRUNCATION = FLAG_TOP_K | FLAG_TOP_P | FLAG_MIN_P  # set only with FLAG_RANDOM
_SEARCHED = FLAG_TOP_K | FLAG_TOP_P  # a threshold to search (min-p's is exp(x - max))

logger = logging.getLogger(__name__)


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


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # Per row, when logprobs were asked for: (logprob of the sampled token, its rank,
    # top-N ids, top-N logprobs); None otherwise.
    logprobs: list[tuple[float, int, list[int], list[float]] | None]


# ---- seeds and Philox ------------------------------------------------------------------

def _signed64(value: int) -> int:
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


def unseeded_key(engine_seed: int, seq_id: int) -> int:
    """The random key of a sequence without a seed: splitmix64 of the engine seed and the
    sequence id (reproducible per engine seed and request order)."""
    z = ((engine_seed & 0xFFFFFFFF) << 32 | (seq_id & 0xFFFFFFFF)) + 0x9E3779B97F4A7C15
    z &= (1 << 64) - 1
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return _signed64(z ^ (z >> 31))


def _mul_hi_lo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32 bits of a * b for a 32-bit constant a and 32-bit values b held in
    int64 (in 16-bit halves: the product itself would overflow int64)."""
    p = (a >> 16) * b
    q = (a & 0xFFFF) * b
    return ((p + (q >> 16)) >> 16) & _U32, (((p & 0xFFFF) << 16) + q) & _U32


def philox_uniform(seed: torch.Tensor, tokens: torch.Tensor,
                   position: torch.Tensor, stream: int = 0) -> torch.Tensor:
    """U(0, 1) float32 for each token id (int64 [..., n]) of rows keyed by seed and
    position (int64 [..., 1]): Triton's tl.philox (4x32, 10 rounds) at counter
    (token // 4, position, stream, 0), output token % 4, its top 23 bits, centred. Bit for
    bit what csrc_triton.sampling._uniform computes."""
    seed = seed.to(torch.int64)
    k0 = (seed & _U32).expand_as(tokens).clone()
    k1 = ((seed >> 32) & _U32).expand_as(tokens).clone()
    c0 = (tokens // 4) & _U32
    c1 = (position & _U32).expand_as(tokens).clone()
    c2 = torch.full_like(tokens, stream)
    c3 = torch.zeros_like(tokens)
    for _ in range(10):
        hi_b, lo_b = _mul_hi_lo(0xCD9E8D57, c2)
        hi_a, lo_a = _mul_hi_lo(0xD2511F53, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0 = (k0 + 0x9E3779B9) & _U32
        k1 = (k1 + 0xBB67AE85) & _U32
    r = torch.stack((c0, c1, c2, c3), dim=-1).gather(-1, (tokens % 4)[..., None])[..., 0]
    return ((r >> 9).to(torch.float32) + 0.5) * (1.0 / 8388608.0)


def gumbel_noise(seed: torch.Tensor, tokens: torch.Tensor,
                 position: torch.Tensor, stream: int = 0) -> torch.Tensor:
    return -torch.log(-torch.log(philox_uniform(seed, tokens, position, stream)))


def first_draws(x: torch.Tensor, seed: torch.Tensor, position: torch.Tensor,
                block: int = DRAW_BLOCK, draws: int = 1) -> torch.Tensor:
    """The pick kernel's first draws over every token of rows x [R, V] (seed, position
    [R]), int64 [R, draws]: draw j takes a block of `block` tokens by Gumbel-max over the
    blocks' log-sum-exp (each relative to its own maximum; made once for every draw), then
    a token of it by Gumbel-max over its values, with Philox streams 2 + 2j and 1 + 2j."""
    rows, vocab = x.shape
    block = min(block, vocab)  # past the vocabulary a block holds only -inf
    blocks = -(-vocab // block)
    grid = torch.nn.functional.pad(x, (0, blocks * block - vocab), value=float("-inf"))
    grid = grid.view(rows, blocks, block)
    top = grid.amax(-1)
    finite = grid > float("-inf")
    mass = torch.where(finite, torch.exp(grid - top[..., None]), 0.0).sum(-1)
    lse = torch.where(top > float("-inf"), top + torch.log(mass), float("-inf"))
    ids = torch.arange(blocks, device=x.device).expand(rows, blocks)
    lanes = torch.arange(block, device=x.device)
    out = []
    for j in range(draws):
        noise = gumbel_noise(seed[:, None], ids, position[:, None], 2 + 2 * j)
        chosen = torch.where(lse > float("-inf"), lse + noise, float("-inf")).argmax(-1)
        tokens = chosen[:, None] * block + lanes
        values = grid[torch.arange(rows, device=x.device)[:, None], chosen[:, None], lanes]
        noise = gumbel_noise(seed[:, None], tokens, position[:, None], 1 + 2 * j)
        score = torch.where(values > float("-inf"), values + noise, float("-inf"))
        out.append(tokens.gather(1, score.argmax(-1)[:, None])[:, 0].clamp(max=vocab - 1))
    return torch.stack(out, dim=1)


def float_keys(x: torch.Tensor) -> torch.Tensor:
    """Order-preserving int32 of float32 values (csrc_triton.sampling._key)."""
    b = x.contiguous().view(torch.int32)
    return torch.where(b >= 0, b, b ^ 0x7FFFFFFF)


# ---- per-slot state ------------------------------------------------------------------------

def slot_flags(p) -> int:
    """The kernels' flags for SamplingParams p (csrc_triton.sampling.FLAG_*)."""
    flags = 0
    if not p.greedy:
        flags |= FLAG_RANDOM
        if p.top_k > 0:
            flags |= FLAG_TOP_K
        if p.top_p < 1.0:
            flags |= FLAG_TOP_P
        if p.min_p > 0.0:
            flags |= FLAG_MIN_P
    if p.logit_bias or p.allowed_token_ids is not None or single_token_bans(
            p._bad_words_token_ids):
        flags |= FLAG_BIAS
    if p.has_penalties:
        flags |= FLAG_PENALTY
    if p.min_tokens > 0:
        flags |= FLAG_BANS
    if p.logprobs is not None:
        flags |= FLAG_LOGPROBS
    if p.structured_outputs is not None or has_sequences(p._bad_words_token_ids):
        flags |= FLAG_GRAMMAR  # its rows may carry a bitmask
    return flags


class SamplingState:
    """Per-slot sampling state on the device (see the module docstring): `ints` [S, 8]
    int64 and `floats` [S, 8] float32 parameters (csrc_triton.sampling's layout),
    `counts` [S, V] int32 (output count << 2 | ban bit | prompt bit) and `bias` [S, V]
    float32. A sequence takes a slot when it first samples (`slot_of`) and gives it back
    when it finishes or is preempted (`release`): a later step's writes into a reused slot
    come after, in stream order, every step launched for its earlier owner.
    `proposals`: a draft model's state, sampling with the target's temperature and
    truncation only (no penalties, bias or bans) and counting nothing."""

    def __init__(self, num_slots: int, vocab: int, device: torch.device, engine_seed: int,
                 proposals: bool = False) -> None:
        self.vocab = vocab
        self.device = device
        self.engine_seed = engine_seed
        self.proposals = proposals
        self.ints = torch.zeros(num_slots, 8, dtype=torch.int64, device=device)
        self.floats = torch.zeros(num_slots, 8, dtype=torch.float32, device=device)
        dense = 1 if proposals else num_slots  # a proposal never reads them
        self.counts = torch.zeros(dense, vocab, dtype=torch.int32, device=device)
        self.bias = torch.zeros(dense, vocab, dtype=torch.float32, device=device)
        self._free = list(range(num_slots - 1, -1, -1))
        self._slots: dict[int, int] = {}   # seq_id -> slot
        self.host_flags: dict[int, int] = {}  # slot -> flags, for the host's decisions
        self._new: list = []               # (slot, seq) admitted since the last flush

    def slots_of(self, seqs) -> list[int]:
        """slot_of for each sequence (one dict lookup each for those that have one)."""
        get = self._slots.get
        slots = [get(s.seq_id) for s in seqs]
        if None in slots:
            slots = [self.slot_of(s) if slot is None else slot
                     for s, slot in zip(seqs, slots)]
        return slots

    def slot_of(self, seq) -> int:
        slot = self._slots.get(seq.seq_id)
        if slot is None:
            if not self._free:
                raise RuntimeError("No sampling slot is free: more sequences sample at once "
                                   "than the engine was built for.")
            slot = self._slots[seq.seq_id] = self._free.pop()
            self._new.append((slot, seq))
        return slot

    def release(self, seq) -> None:
        slot = self._slots.pop(seq.seq_id, None)
        if slot is not None:
            self._free.append(slot)
            self.host_flags.pop(slot, None)

    def flush(self) -> None:
        """Write the slots admitted since the last flush: a few batched copies and
        scatters, however many were admitted; O(prompt + output) once per admission."""
        if not self._new:
            return
        new, self._new = self._new, []
        n = len(new)
        ints = np.zeros((n, 8), dtype=np.int64)
        floats = np.zeros((n, 8), dtype=np.float32)
        dense = []
        for i, (slot, seq) in enumerate(new):
            p = seq.params
            flags = slot_flags(p)
            if self.proposals:
                flags &= FLAG_RANDOM | FLAG_TOP_K | FLAG_TOP_P | FLAG_MIN_P | FLAG_GRAMMAR
            top_k = p.top_k if 0 < p.top_k < self.vocab else 0
            if not top_k:  # a top_k of the whole vocabulary keeps everything
                flags &= ~FLAG_TOP_K
            self.host_flags[slot] = flags
            seed = (_signed64(p.seed) if p.seed is not None
                    else unseeded_key(self.engine_seed, seq.seq_id))
            ints[i, _I_FLAGS] = flags
            ints[i, _I_TOP_K] = top_k
            ints[i, _I_SEED] = seed
            ints[i, _I_PROMPT_LEN] = seq.num_prompt_tokens
            ints[i, _I_MIN_TOKENS] = p.min_tokens
            ints[i, _I_LOGPROBS] = p.logprobs or 0
            floats[i, _F_TEMPERATURE] = 1.0 if p.greedy else p.temperature
            floats[i, _F_TOP_P] = p.top_p
            floats[i, _F_MIN_P] = p.min_p
            floats[i, _F_REP] = p.repetition_penalty
            floats[i, _F_FREQ] = p.frequency_penalty
            floats[i, _F_PRES] = p.presence_penalty
            # The kernels scale by 1 / temperature (a multiply; their division is
            # approximate), rounded once here so the reference scales alike.
            floats[i, _F_INV_TEMPERATURE] = np.float32(1.0) / floats[i, _F_TEMPERATURE]
            if flags & (FLAG_PENALTY | FLAG_BANS | FLAG_BIAS):
                dense.append((slot, seq, flags))
        index = to_device(np.asarray([slot for slot, _ in new], dtype=np.int64), self.device)
        self.ints.index_copy_(0, index, to_device(ints, self.device))
        self.floats.index_copy_(0, index, to_device(floats, self.device))
        if dense:
            self._write_dense(dense)

    def _write_dense(self, entries: list) -> None:
        """counts and bias rows of newly admitted slots: zeroed, then the prompt's
        presence, the banned tokens, the output's counts (a preempted sequence's tokens so
        far) and the bias written by scatters over all of them at once."""
        vocab = self.vocab
        slots = np.asarray([slot for slot, _, _ in entries], dtype=np.int64)
        self.counts.index_fill_(0, to_device(slots, self.device), 0)
        prompt, banned, output, bias_at, bias_val, allowed = [], [], [], [], [], []
        for slot, seq, flags in entries:
            base = slot * vocab
            if flags & FLAG_PENALTY:
                ids = np.asarray(seq.prompt_token_ids, dtype=np.int64)
                prompt.append(base + np.unique(ids))
                out = np.asarray(seq.output_token_ids, dtype=np.int64)
                output.append(base + out[out >= 0])  # not an in-flight placeholder
            if flags & FLAG_BANS:
                p = seq.params
                ids = {t for t in set(p.stop_token_ids) | set(p._eos_token_ids) if t < vocab}
                banned.append(base + np.asarray(sorted(ids), dtype=np.int64))
            if flags & FLAG_BIAS:
                p = seq.params
                if p.allowed_token_ids is None:
                    self.bias[slot].zero_()
                else:  # -inf but for the allowed tokens: filled here, on the device
                    self.bias[slot].fill_(float("-inf"))
                    allowed.append(base + np.unique(np.asarray(p.allowed_token_ids,
                                                               dtype=np.int64)))
                bias_at.append(base + np.asarray(list(p.logit_bias or {}), dtype=np.int64))
                bias_val.append(np.asarray(list((p.logit_bias or {}).values()),
                                           dtype=np.float32))
                for t in single_token_bans(p._bad_words_token_ids):
                    bias_at.append(np.asarray([base + t], dtype=np.int64))
                    bias_val.append(np.asarray([float("-inf")], dtype=np.float32))
        flat = self.counts.view(-1)
        for parts, value in ((prompt, PROMPT_BIT), (banned, BAN_BIT),
                             (output, 1 << COUNT_SHIFT)):
            if parts and sum(len(p) for p in parts):
                at = to_device(np.concatenate(parts), self.device)
                flat.index_put_((at,), torch.full((), value, dtype=torch.int32,
                                                  device=self.device), accumulate=True)
        if allowed:
            at = to_device(np.concatenate(allowed), self.device)
            self.bias.view(-1).index_fill_(0, at, 0.0)
        if bias_at:
            at = to_device(np.concatenate(bias_at), self.device)
            val = to_device(np.concatenate(bias_val), self.device)
            self.bias.view(-1).index_put_((at,), val, accumulate=True)

    def count_tokens(self, seq, tokens: list[int]) -> None:
        """Add tokens to a penalized sequence's output counts (speculative steps: the
        accepted tokens, once the host has verified them)."""
        slot = self._slots.get(seq.seq_id)
        if slot is None or not tokens or not self.host_flags.get(slot, 0) & FLAG_PENALTY:
            return
        at = to_device(np.asarray([slot * self.vocab + t for t in tokens], dtype=np.int64),
                       self.device)
        self.counts.view(-1).index_put_(
            (at,), torch.full((), 1 << COUNT_SHIFT, dtype=torch.int32, device=self.device),
            accumulate=True)


# ---- one step's rows -----------------------------------------------------------------------

@dataclass
class RowInputs:
    """A step's sampling rows, on the device: slot [R] int32 (-1: padding), position [R]
    int64 (the index in its sequence of the token drawn), flags [R] int32
    (ROW_UPDATE_COUNTS | 1 + its mask row << ROW_MASK_SHIFT), extra [R, KX] int32 (drafts
    before this row's position, counted as output by its penalties; -1: none), mask
    [R, ceil(V / 32)] int32 (the step's grammar bitmasks, rows by first use)."""

    slot: torch.Tensor
    position: torch.Tensor
    flags: torch.Tensor
    extra: torch.Tensor
    mask: torch.Tensor

    def narrow(self, n: int) -> "RowInputs":
        return RowInputs(self.slot[:n], self.position[:n], self.flags[:n], self.extra[:n],
                         self.mask)


def _row_arrays(rows: int, kx: int, **where):
    """A step's row inputs packed for two copies (cuda_graph_runner.PackedArrays): position
    (int64); slot, flags and the extra drafts, as its table rows (int32)."""
    from .cuda_graph_runner import PackedArrays
    return PackedArrays({"position": rows}, {"slot": rows, "flags": rows}, rows, kx, **where)


class SampledRows:
    """A step's tokens (and logprobs) on the device, copied to the host behind the step;
    `read()` waits for them. n rows; `logprob_rows`: the rows that want logprobs."""

    def __init__(self, tokens: torch.Tensor, logprobs: tuple | None,
                 logprob_rows: list[int], host, wide: tuple | None = None) -> None:
        self.tokens = tokens  # the next pipelined step gathers its inputs from these
        n = tokens.shape[0]
        self.n = n
        self.logprob_rows = logprob_rows
        self._wide = wide  # wide_logprobs' (values, ids) for rows past MAX_LOGPROBS
        self.event = None
        self._host = host
        if host is None:  # on the CPU: nothing to overlap; the buffer is reused next step
            self._cpu_tokens = tokens.tolist()
            self._lp = logprobs
            return
        host.tokens[:n].copy_(tokens, non_blocking=True)
        self._lp = None
        if logprobs is not None:
            for dst, src in zip(host.logprobs, logprobs):
                dst[:n].copy_(src, non_blocking=True)
            self._lp = tuple(t[:n] for t in host.logprobs)
        self.event = torch.cuda.Event()
        self.event.record()

    def read(self, want: list[int | None]) -> SamplerOutput:
        """The host's copy: token ids, and for rows whose want[i] is not None its
        (token logprob, rank, top-N ids, top-N logprobs)."""
        if self.event is not None:
            self.event.synchronize()
            tokens = self._host.tokens[:self.n].tolist()
        else:
            tokens = self._cpu_tokens
        logprobs: list = []
        if self.logprob_rows:
            token_lp, rank, top_val, top_idx = (t.tolist() for t in self._lp)
            if self._wide is not None:
                wide_val, wide_idx = (t.tolist() for t in self._wide)
                wide_of = dict(zip(self.logprob_rows, range(len(self.logprob_rows))))
            logprobs = [None] * self.n
            for i in self.logprob_rows:
                k = want[i] or 0
                if k > MAX_LOGPROBS:
                    j = wide_of[i]
                    logprobs[i] = (token_lp[i], rank[i], wide_idx[j][:k], wide_val[j][:k])
                else:
                    logprobs[i] = (token_lp[i], rank[i], top_idx[i][:k], top_val[i][:k])
        return SamplerOutput(tokens, logprobs)


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on the device without waiting for the GPU: through pinned memory, whose
    buffer PyTorch's host allocator keeps until the copy is done. A copy from pageable
    memory synchronizes the stream: each admission of a sampled or penalized request
    waited for the step in flight, and the host's preparation of the next step stopped
    overlapping the GPU (plain greedy requests take no slot and never paid it)."""
    t = torch.from_numpy(array)
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def wide_logprobs(logits: torch.Tensor, rows: list[int],
                  wanted: list[int | None]) -> tuple | None:
    """(values, ids) [len(rows), max N] of the most likely tokens under the raw logits'
    log-softmax of the logprob rows `rows`, when one asks for more than the kernels'
    MAX_LOGPROBS (max_logprobs raised); None otherwise. wanted: those rows' N. A PyTorch
    top-k (a sort, for the whole vocabulary) queued behind the step, read with it."""
    k = max((w or 0 for w in wanted), default=0)
    if k <= MAX_LOGPROBS:
        return None
    picked = logits[torch.tensor(rows, device=logits.device)].float()
    return torch.log_softmax(picked, dim=-1).topk(k, dim=-1)


class _HostCopies:
    """Pinned host buffers a step's results are copied into (two sets alternate: the
    previous step's copy may still be landing)."""

    def __init__(self, rows: int) -> None:
        self.tokens = torch.zeros(rows, dtype=torch.int64, pin_memory=True)
        self.logprobs = (torch.zeros(rows, dtype=torch.float32, pin_memory=True),
                         torch.zeros(rows, dtype=torch.int32, pin_memory=True),
                         torch.zeros(rows, MAX_LOGPROBS, dtype=torch.float32, pin_memory=True),
                         torch.zeros(rows, MAX_LOGPROBS, dtype=torch.int32, pin_memory=True))


class Sampler:
    """Samples a step's rows (see the module docstring). max_rows: the most rows a step
    samples; num_slots: the most sequences sampling at once; kx: the most drafts a
    sequence verifies in a step (speculative decoding)."""

    def __init__(self, vocab_size: int, device: torch.device, seed: int = 0, *,
                 max_rows: int = 256, num_slots: int = 256, kx: int = 0,
                 proposals: bool = False) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.max_rows = max_rows
        self.state = SamplingState(num_slots, vocab_size, device, seed, proposals)
        self.on_gpu = device.type == "cuda"
        # The Triton kernels draw on a GPU; the PyTorch reference on a CPU, or where the
        # kernels failed their start-up check (check_kernels).
        self.kernels = self.on_gpu
        pin = self.on_gpu
        self._staging = [_row_arrays(max_rows, max(kx, 1), pin_memory=pin) for _ in range(2)]
        self._turn = 0
        # The last staged batch (its sequences in order), their slots and logprob rows: a
        # decode step's batch is mostly the step before's, and looking its rows' slots up
        # again was a loop over the sequences (150 us a step at 256 rows on the CPU,
        # bench/results/2026-12-05-cpu-engine-host-sampling).
        self._last_batch: tuple[list, np.ndarray, list[int], bool, bool] | None = None
        self.truncating = True  # whether the staged rows hold top-k, top-p or min-p
        self.searching = True   # whether they hold top-k or top-p (a threshold to search)
        self._dev = _row_arrays(max_rows, max(kx, 1), device=device)
        d = self._dev
        # Grammar bitmasks (structured outputs): filled on the host by `before_sample`
        # (the engine's hook, called with the step's rows first thing in `sample`), copied
        # to the device rows the kernels read; two host sets alternate like the staging.
        words = -(-vocab_size // 32)  # a bit a token
        self.rows = RowInputs(d.slot, d.position, d.flags, d.tables,
                              torch.zeros(max_rows, words, dtype=torch.int32, device=device))
        self._mask_host = [torch.zeros(max_rows, words, dtype=torch.int32, pin_memory=pin)
                           for _ in range(2)]
        self._mask_turn = 0
        self.before_sample = None  # (sampler, seqs, positions) -> {row: mask row}
        self.graphs = None  # SamplerGraphs, set by the model runner when it captures
        if self.on_gpu:
            self.scratch = _Scratch(max_rows, vocab_size, device)
            self.out = _Outputs(max_rows, vocab_size, device)
            self._host = [_HostCopies(max_rows) for _ in range(2)]
            self._host_turn = 0

    # ---- the host's part of a step ----------------------------------------------------

    def needs_rows(self, seqs) -> bool:
        """Whether these rows need the sampler (not only the step's argmax)."""
        return not all(s.plain_greedy for s in seqs)

    def release(self, seq) -> None:
        self.state.release(seq)
        self._last_batch = None

    def mask_buffer(self) -> torch.Tensor:
        """The host bitmask rows [max_rows, ceil(V / 32)] int32 this step's masks go in."""
        return self._mask_host[self._mask_turn]

    def stage(self, seqs, positions: list[int], extras: list[list[int]] | None = None,
              counted: list[bool] | None = None, padded: int | None = None,
              masks: dict[int, int] | None = None) -> list[int]:
        """Write the rows' inputs and copy them to the device; returns the rows that want
        logprobs. counted[i] False: row i's token is not counted now (a speculative
        row). padded: rows up to this are padding (slot -1). masks: row -> its row of
        mask_buffer() (rows 0..len(masks)-1 filled)."""
        n = len(seqs)
        if n > self.max_rows:
            raise RuntimeError(f"{n} sampling rows in one step; the sampler holds "
                               f"{self.max_rows}.")
        state = self.state
        last = self._last_batch
        if last is not None and last[0] == seqs:  # the same objects, in the same order
            _, slots, lp_rows, self.truncating, self.searching = last
        else:
            slots = np.asarray(state.slots_of(seqs), dtype=np.int32)
            state.flush()  # the admitted slots' state, and their host_flags
            flags = [state.host_flags[s] for s in slots.tolist()]
            lp_rows = [i for i, f in enumerate(flags) if f & FLAG_LOGPROBS]
            self.truncating = any(f & _TRUNCATION for f in flags)
            self.searching = any(f & _SEARCHED for f in flags)
            self._last_batch = (list(seqs), slots, lp_rows, self.truncating, self.searching)
        # Two staging sets alternate: the previous step's copies may not have run yet.
        st = self._staging[self._turn]
        self._turn ^= 1
        end = padded or n
        st.slot_np[:n] = slots
        st.slot_np[n:end] = -1
        st.position_np[:n] = positions
        st.flags_np[:end] = ROW_UPDATE_COUNTS
        if counted is not None:
            st.flags_np[:n] = [ROW_UPDATE_COUNTS if c else 0 for c in counted]
        if masks:
            for row, m in masks.items():
                st.flags_np[row] |= (m + 1) << ROW_MASK_SHIFT
            host = self._mask_host[self._mask_turn]
            self._mask_turn ^= 1
            self.rows.mask[:len(masks)].copy_(host[:len(masks)], non_blocking=True)
        extra = st.tables_np
        extra[:end] = -1
        if extras is not None:
            for i, e in enumerate(extras):
                if e:
                    extra[i, :len(e)] = e[:extra.shape[1]]
        st.copy_to(self._dev, end)
        return lp_rows

    # ---- a step ------------------------------------------------------------------------

    def sample(self, logits: torch.Tensor, greedy: torch.Tensor | None, seqs,
               positions: list[int], extras: list[list[int]] | None = None,
               counted: list[bool] | None = None) -> SampledRows:
        """Queue the draw of one token per row (logits row i is seqs[i]'s, at
        positions[i]); nothing here waits for the device. greedy: the rows' argmax if the
        step computed it. Rows that are all plain greedy take that argmax: the common,
        hottest case needs no slot, staging or kernel."""
        if not self.needs_rows(seqs):
            return self.wrap(greedy if greedy is not None else argmax_rows(logits))
        masks = self.before_sample(self, seqs, positions) if self.before_sample else None
        n = logits.shape[0]
        graphs = self.graphs
        bucket = graphs.bucket(n) if graphs is not None and graphs.takes(logits) else None
        lp_rows = self.stage(seqs, positions, extras, counted, padded=bucket, masks=masks)
        wide = wide_logprobs(logits, lp_rows, [seqs[i].params.logprobs for i in lp_rows])
        if not self.kernels:
            tokens, lp = sample_reference(logits, self.state, self.rows.narrow(n),
                                          bool(lp_rows))
            return SampledRows(tokens, lp, lp_rows, None, wide)
        if bucket is not None:
            graphs.replay(bucket, bool(lp_rows), self.truncating, self.searching)
        else:
            if greedy is None:
                greedy = argmax_rows(logits)
            self.launch(logits, greedy, n, bool(lp_rows), self.truncating, self.searching)
        return self._result(n, lp_rows, wide)

    def check_kernels(self) -> bool:
        """Run the kernels once on a small mixed batch at this vocabulary against the
        reference. Kernels that fail to compile, or disagree on more than one row of 16
        (rounding can move a boundary), leave the reference to sample: slower, never
        wrong. Returns whether the kernels stay."""
        from ..sampling_params import SamplingParams

        settings = [dict(temperature=0.0), dict(temperature=0.0, repetition_penalty=1.2),
                    dict(temperature=0.8, top_k=20, top_p=0.9, seed=1),
                    dict(temperature=1.0, seed=2), dict(temperature=0.7, top_p=0.8, seed=3),
                    dict(temperature=0.9, min_p=0.1, seed=4, logprobs=2),
                    dict(temperature=1.1, top_k=2000, seed=5),
                    dict(temperature=0.0, presence_penalty=0.5, logit_bias={3: 2.0})] * 2
        seqs = []
        for i, kw in enumerate(settings):
            params = SamplingParams(**kw)
            params._eos_token_ids = frozenset([0])
            seqs.append(_CheckRow(i, params, [1 + i, 5, 7], [9, 9, 11]))
        g = torch.Generator(device=self.device).manual_seed(0)
        logits = torch.randn(len(seqs), self.vocab_size, device=self.device, generator=g) * 3
        positions = [6] * len(seqs)
        try:
            mine = Sampler(self.vocab_size, self.device, max_rows=len(seqs),
                           num_slots=len(seqs))
            got = mine.sample_now(logits, argmax_rows(logits), seqs, positions).token_ids
            ref = Sampler(self.vocab_size, self.device, max_rows=len(seqs),
                          num_slots=len(seqs))
            ref.kernels = False
            want = ref.sample_now(logits, None, seqs, positions).token_ids
            wrong = sum(a != b for a, b in zip(got, want))
        except Exception:  # noqa: BLE001 - any failure means: don't use them
            logger.exception("the sampler's kernels failed their start-up check")
            wrong = len(seqs)
        if wrong > 1:
            logger.warning("The sampler's Triton kernels disagree with the reference on %d "
                           "of %d rows on this device: sampling with PyTorch ops instead "
                           "(slower).", wrong, len(seqs))
            self.kernels = False
        return self.kernels

    def launch(self, logits: torch.Tensor, greedy: torch.Tensor, n: int,
               want_logprobs: bool, truncating: bool = True, searching: bool = True) -> None:
        from csrc_triton.sampling import sample_rows
        sample_rows(logits, greedy, self.rows.narrow(n), self.state, self.scratch, self.out,
                    want_logprobs, truncating=truncating, searching=searching)

    def _result(self, n: int, lp_rows: list[int], wide=None) -> SampledRows:
        o = self.out
        lp = (o.token_lp[:n], o.rank[:n], o.top_val[:n], o.top_idx[:n]) if lp_rows else None
        return SampledRows(o.token[:n], lp, lp_rows, self._next_host(), wide)

    def wrap(self, greedy: torch.Tensor) -> SampledRows:
        """A step's argmax as its tokens (rows that need nothing else), copied back behind
        it like sampled ones."""
        return SampledRows(greedy, None, [], self._next_host() if self.on_gpu else None)

    def _next_host(self) -> _HostCopies:
        self._host_turn ^= 1
        return self._host[self._host_turn]

    def sample_now(self, logits, greedy, seqs, positions, extras=None,
                   counted=None) -> SamplerOutput:
        """sample(), then wait for the tokens."""
        rows = self.sample(logits, greedy, seqs, positions, extras, counted)
        return rows.read([s.params.logprobs for s in seqs])


@dataclass
class _CheckRow:
    """What the sampler reads of a sequence (check_kernels' rows)."""

    seq_id: int
    params: object
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    plain_greedy: bool = False  # every row goes through the kernels

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


class SamplerGraphs:
    """The sampler's kernels captured as CUDA graphs per row bucket (the decode batch
    buckets), with and without the logprob kernels, reading the step runners' shared
    logits and argmax buffers: a sampled step replays one small graph after its model
    graph. Padding rows have slot -1: their programs return at once."""

    def __init__(self, sampler: Sampler, logits: torch.Tensor, greedy: torch.Tensor) -> None:
        from .cuda_graph_runner import decode_buckets
        self.sampler = sampler
        self.logits = logits
        self.greedy = greedy
        rows = min(sampler.max_rows, logits.shape[0])
        self.buckets = decode_buckets(rows)
        # (bucket, logprobs, truncating, searching): a batch without top-k, top-p or min-p
        # replays a graph without their kernels; one with min-p alone, without top-k and
        # top-p's threshold search.
        self.graphs: dict[tuple[int, bool, bool, bool], torch.cuda.CUDAGraph] = {}

    def takes(self, logits: torch.Tensor) -> bool:
        return (logits.data_ptr() == self.logits.data_ptr()
                and logits.shape[0] <= self.buckets[-1])

    def bucket(self, n: int) -> int:
        from .cuda_graph_runner import bucket_for
        return bucket_for(n, self.buckets)

    @torch.inference_mode()
    def capture(self) -> None:
        s = self.sampler
        s.rows.slot.fill_(-1)
        kinds = [(lp, *cut) for lp in (False, True)
                 for cut in ((False, False), (True, False), (True, True))]
        for b in self.buckets:  # compile every launch's variant outside the graphs
            for kind in kinds:
                s.launch(self.logits[:b], self.greedy[:b], b, *kind)
        torch.cuda.synchronize(s.device)
        pool = None
        for b in reversed(self.buckets):
            for kind in kinds:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    s.launch(self.logits[:b], self.greedy[:b], b, *kind)
                pool = pool or graph.pool()
                self.graphs[(b, *kind)] = graph
        torch.cuda.synchronize(s.device)

    def replay(self, bucket: int, want_logprobs: bool, truncating: bool,
               searching: bool) -> None:
        self.graphs[bucket, want_logprobs, truncating, searching].replay()


class _Scratch:
    """The kernels' work buffers (csrc_triton.sampling.sample_rows)."""

    def __init__(self, rows: int, vocab: int, device: torch.device) -> None:
        from csrc_triton.sampling import GATHER_CAP, sampling_splits
        splits = max(sampling_splits(r, vocab, device) for r in (1, rows))
        self.x = torch.empty(rows, vocab, dtype=torch.float32, device=device)
        self.part = torch.empty(rows * splits * 8 + 8, dtype=torch.float32, device=device)
        self.part_idx = torch.empty(rows * splits + 1, dtype=torch.int32, device=device)
        self.g_val = torch.empty(rows, GATHER_CAP, dtype=torch.float32, device=device)
        self.g_idx = torch.empty(rows, GATHER_CAP, dtype=torch.int32, device=device)
        self.block_max = torch.empty(rows * -(-vocab // DRAW_BLOCK), dtype=torch.float32,
                                     device=device)
        self.block_lse = torch.empty_like(self.block_max)
        self.first = torch.empty(rows, FIRST_DRAWS, dtype=torch.int64, device=device)
        self.lo = torch.empty(rows, dtype=torch.int64, device=device)
        self.hi = torch.empty(rows, dtype=torch.int64, device=device)
        self.count = torch.empty(rows, dtype=torch.int32, device=device)
        self.search = torch.zeros(rows, 6, dtype=torch.int64, device=device)
        self.search_f = torch.zeros(rows, 2, dtype=torch.float32, device=device)
        self.pivots = torch.zeros(rows, 16, dtype=torch.int64, device=device)
        self.level_count = torch.empty(rows * splits * 16, dtype=torch.int32, device=device)
        self.level_mass = torch.empty(rows * splits * 16, dtype=torch.float32, device=device)
        # The work lists (search, gather, draw, fill): their rows, lengths, each row's place.
        self.lists = torch.empty(4 * rows, dtype=torch.int32, device=device)
        self.list_len = torch.zeros(4, dtype=torch.int32, device=device)
        self.list_at = torch.empty(4 * rows, dtype=torch.int32, device=device)
        # Per row: 0 where prepare stored its values in x, else 1 / temperature (x is
        # remade from the logits).
        self.raw_scale = torch.empty(rows, dtype=torch.float32, device=device)
        self.tau = torch.empty(rows, dtype=torch.int64, device=device)
        self.peak = torch.empty(rows, dtype=torch.float32, device=device)
        self.lse = torch.empty(rows, dtype=torch.float32, device=device)


class _Outputs:
    """Where the kernels put a step's tokens and logprobs."""

    def __init__(self, rows: int, vocab: int, device: torch.device) -> None:
        parts = -(-vocab // 4096)
        self.token = torch.zeros(rows, dtype=torch.int64, device=device)
        self.token_lp = torch.zeros(rows, dtype=torch.float32, device=device)
        self.rank = torch.zeros(rows, dtype=torch.int32, device=device)
        self.top_val = torch.zeros(rows, MAX_LOGPROBS, dtype=torch.float32, device=device)
        self.top_idx = torch.zeros(rows, MAX_LOGPROBS, dtype=torch.int32, device=device)
        self.lp_val = torch.empty(rows * parts * MAX_LOGPROBS, dtype=torch.float32,
                                  device=device)
        self.lp_idx = torch.empty(rows * parts * MAX_LOGPROBS, dtype=torch.int32,
                                  device=device)
        self.lp_rank = torch.empty(rows * parts, dtype=torch.int32, device=device)


# ---- the PyTorch mirror ------------------------------------------------------------------

_BITS = None


def unpack_bitmask(words: torch.Tensor, vocab: int) -> torch.Tensor:
    """bool [M, vocab] of bitmask rows [M, ceil(vocab / 32)] int32 (token t: bit t % 32
    of word t // 32), through the words' little-endian bytes."""
    global _BITS
    if _BITS is None or _BITS.device != words.device:
        _BITS = torch.tensor([1 << b for b in range(8)], dtype=torch.uint8,
                             device=words.device)
    octets = words.contiguous().view(torch.uint8)  # [M, 4 W]: byte k holds tokens 8k..8k+7
    return (octets[..., None] & _BITS).ne(0).flatten(1)[:, :vocab]


def process_logits(logits: torch.Tensor, state: SamplingState,
                   rows: RowInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, flags): each row's values after bias, bans, penalties and (random rows)
    temperature, float32 [R, V], in the kernels' order and arithmetic; flags [R]."""
    slot = rows.slot.long()
    ints, floats = state.ints[slot], state.floats[slot]
    flags = ints[:, _I_FLAGS]

    def has(flag: int) -> torch.Tensor:
        return ((flags & flag) != 0)[:, None]

    x = logits.float().clone()
    mask_row = (rows.flags.long() >> ROW_MASK_SHIFT) * ((flags & FLAG_GRAMMAR) != 0)
    masked = torch.nonzero(mask_row > 0)[:, 0]
    if masked.numel():
        allowed = unpack_bitmask(rows.mask[mask_row[masked] - 1], x.shape[1])
        x[masked] = x[masked].masked_fill_(~allowed, float("-inf"))
    if bool((flags & FLAG_BIAS).any()):
        x = torch.where(has(FLAG_BIAS), x + state.bias[slot], x)
    if bool((flags & (FLAG_BANS | FLAG_PENALTY)).any()):
        counts = state.counts[slot]
        banning = has(FLAG_BANS) & ((rows.position - ints[:, _I_PROMPT_LEN])
                                    < ints[:, _I_MIN_TOKENS])[:, None]
        x = torch.where(banning & ((counts & BAN_BIT) != 0), float("-inf"), x)
        times = counts >> COUNT_SHIFT
        for j in range(rows.extra.shape[1]):
            e = rows.extra[:, j].long()
            hit = torch.arange(x.shape[1], device=x.device)[None, :] == e[:, None]
            times = times + hit.to(times.dtype)
        rep = floats[:, _F_REP, None]
        seen = ((counts & PROMPT_BIT) != 0) | (times > 0)
        penalized = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
        penalized = (penalized - floats[:, _F_FREQ, None] * times.float()
                     - floats[:, _F_PRES, None] * (times > 0).float())
        x = torch.where(has(FLAG_PENALTY), penalized, x)
    if bool((flags & FLAG_RANDOM).any()):
        x = torch.where(has(FLAG_RANDOM), x * floats[:, _F_INV_TEMPERATURE, None], x)
    return x, flags


def kept_tokens(x: torch.Tensor, flags: torch.Tensor, top_k: torch.Tensor,
                top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Which tokens each random row may draw [R, V] (the sort-based definition): top-k
    keeps values >= the k-th largest, top-p then the largest values whose mass above them
    (relative to what top-k kept) stays under top_p, ties at either boundary all kept;
    min-p those with exp(x - max) >= min_p."""
    finite = x > float("-inf")
    values = x.sort(dim=-1, descending=True).values
    n_finite = finite.sum(-1)
    rows = torch.arange(x.shape[0], device=x.device)
    tau = values[rows, n_finite.clamp(min=1) - 1]  # the least finite value: keep all
    use_k = ((flags & FLAG_TOP_K) != 0) & (top_k < n_finite)
    kth = values[rows, (top_k - 1).clamp(min=0, max=x.shape[1] - 1)]
    tau = torch.where(use_k, kth, tau)
    use_p = (flags & FLAG_TOP_P) != 0
    if bool(use_p.any()):
        peak = values[:, :1]
        inside = values >= tau[:, None]
        w = torch.where(inside, torch.exp(values - peak), 0.0)
        total = torch.cumsum(w, -1)
        kept = inside & (total - w < top_p[:, None] * total[:, -1:])
        last = torch.where(kept, torch.arange(x.shape[1], device=x.device), -1).amax(-1)
        tau = torch.where(use_p, values[rows, last.clamp(min=0)], tau)
    keep = finite & (float_keys(x) >= float_keys(tau)[:, None])
    use_min_p = ((flags & FLAG_MIN_P) != 0)[:, None]
    return keep & (~use_min_p | (torch.exp(x - values[:, :1]) >= min_p[:, None]))


def sample_reference(logits: torch.Tensor, state: SamplingState, rows: RowInputs,
                     want_logprobs: bool, block: int = DRAW_BLOCK
                     ) -> tuple[torch.Tensor, tuple | None]:
    """The kernels' result in PyTorch: tokens [R] int64 and, if asked, (token logprob,
    rank, top-20 logprobs, top-20 ids) per row; the slots' counts updated as the kernels
    do. Rows with no flags take the raw argmax. A random row without top-k draws first
    over every token (first_draws, in blocks of `block`: the kernels' block), a top-p or
    min-p row up to FIRST_DRAWS times, and keeps the first token that is kept; other random
    rows, and those whose first draws were all cut, draw by Gumbel-max over the kept set."""
    n, vocab = logits.shape
    x, flags = process_logits(logits, state, rows)
    slot = rows.slot.long()
    ints, floats = state.ints[slot], state.floats[slot]
    tokens = x.argmax(dim=-1)
    random = (flags & FLAG_RANDOM) != 0
    if bool(random.any()):
        r = torch.nonzero(random)[:, 0]
        keep = kept_tokens(x[r], flags[r], ints[r, _I_TOP_K], floats[r, _F_TOP_P],
                           floats[r, _F_MIN_P])
        at_row, at_token = torch.nonzero(keep, as_tuple=True)
        score = torch.full_like(keep, float("-inf"), dtype=torch.float32)
        noise = gumbel_noise(ints[r[at_row], _I_SEED], at_token, rows.position[r[at_row]])
        score[at_row, at_token] = x[r[at_row], at_token] + noise
        drawn = score.argmax(dim=-1)
        first = (flags[r] & FLAG_TOP_K) == 0
        if bool(first.any()):
            d = r[first]
            truncated = (flags[d] & _TRUNCATION) != 0
            picks = first_draws(x[d], ints[d, _I_SEED], rows.position[d], block,
                                FIRST_DRAWS if bool(truncated.any()) else 1)
            kept = keep[first].gather(1, picks)
            kept[:, 1:] &= truncated[:, None]  # untruncated rows draw once
            # The first kept draw, else the draw over the kept set (a row with none kept).
            at = torch.where(kept, torch.arange(picks.shape[1], device=kept.device),
                             picks.shape[1]).amin(1)
            chosen = picks.gather(1, at.clamp(max=picks.shape[1] - 1)[:, None])[:, 0]
            drawn[first] = torch.where(at < picks.shape[1], chosen, drawn[first])
        tokens[r] = drawn
    count = (flags & FLAG_PENALTY) != 0
    count &= (rows.flags & ROW_UPDATE_COUNTS) != 0
    if bool(count.any()):
        at = slot[count] * vocab + tokens[count]
        state.counts.view(-1).index_put_(
            (at,), torch.tensor(1 << COUNT_SHIFT, dtype=torch.int32), accumulate=True)
    if not want_logprobs:
        return tokens, None
    raw = torch.log_softmax(logits.float(), dim=-1)
    token_lp = raw.gather(1, tokens[:, None])[:, 0]
    rank = (logits.float() > logits.float().gather(1, tokens[:, None])).sum(-1) + 1
    top_val, top_idx = raw.topk(min(MAX_LOGPROBS, vocab), dim=-1)
    return tokens, (token_lp, rank.to(torch.int32), top_val, top_idx.to(torch.int32))
