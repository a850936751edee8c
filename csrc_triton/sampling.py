"""The sampler's kernels: a batch of logits rows to tokens, on the device, without sorting.

Public API (re-exported by ``csrc_triton``)
-------------------------------------------
sample_rows(logits, greedy, rows, state, scratch, out)
    one step's tokens (and, for the rows that ask, logprobs) from `logits` [R, V]:
    `rows` the per-row inputs (slot, position), `state` the per-slot sampling state,
    `scratch` the kernels' work buffers, `out` where tokens and logprobs land
    (worker/sampler.py builds all four; see it for their layout).
sampling_splits(rows, vocab, device): how many programs share one row's vocabulary.

Each row belongs to a slot (a running sequence) whose parameters, token counts and bias
live on the device. Per row, in order (vLLM's): a grammar's token mask (structured
outputs: a bitmask row the host fills each step), logit_bias, min_tokens' bans, the
repetition / frequency / presence penalties, then for a random row temperature, top-k,
top-p and min-p, and a Gumbel-max draw:

    token = argmax over the kept tokens i of  x_i + g_i,   g_i = -log(-log(u_i))

which draws token i with probability proportional to exp(x_i). u_i is Philox's (4x32-10,
Triton's `tl.philox`) output for key = the row's seed and counter = (i // 4, position,
stream, 0), output i % 4: the same numbers whatever the batch, eager or graphed, on any
device, and worker/sampler.py's PyTorch mirror computes them bit for bit.

A row without top-k (temperature alone, or with top-p or min-p) is first drawn over every
token in two stages that need noise for one block of tokens, not for each of the
vocabulary's (the pick kernel): a block b of BLOCK tokens by Gumbel-max over the blocks'
log-sum-exp L_b (stream 2, counter b), then a token of b by Gumbel-max over its values
(stream 1). P(token i) = exp(L_b) / sum exp(L) * exp(x_i) / exp(L_b) = exp(x_i) / sum
exp(x): the same distribution as one Gumbel-max over the row. The blocks are fixed in the
vocabulary (not in a program's split), so the draw does not depend on the batch.

The kept tokens are those whose value is at least a threshold tau (top-k and top-p keep
the largest values; ties at the boundary are all kept) and, with min_p, whose
exp(x - max) is at least min_p. tau is found exactly without sorting the vocabulary:
values map to order-preserving int32 keys, and a search narrows an interval (lo, hi] of
keys holding tau with 8 pivots a pass (count, or probability mass, above each), until the
interval holds at most CAP values; those are gathered, sorted and the boundary read off.
Kept tokens that fit the gathered list are drawn from it; otherwise one more pass over
the row draws.

A row with top-p or min-p but no top-k draws FIRST_DRAWS times so, independently
(streams 1 + 2j and 2 + 2j for draw j), and takes the first draw whose token is kept; if
none is, it draws from the kept set with independent numbers (stream 0): rejection
sampling, exactly the truncated distribution (each stage gives a kept i with probability
p_i, and P(i) = p_i (1 + c + c^2 + ...) = p_i / P(kept) with c = 1 - P(kept)). For top-p a
draw is kept with probability at least top_p, so at 0.95 one row in 160,000 searches. Kept means its value reaches tau: for top-p, the mass of the values
strictly above it is under top_p of the row's (one pass, the check kernel); for min-p,
exp(x - max) >= min_p. Only the rows whose first draw is not kept search for tau.

Kernels, in launch order: prepare (rows x splits: the processed values, their maximum,
argmax, sum of exp, and the raw logits' log-sum-exp for logprob rows; each block's
log-sum-exp for a row without top-k, which then stores its values only where it is
truncated and they are more than logits / temperature), pick (a program a row: the
first draw of a row without top-k), check (rows x splits, a top-p row drawn first: kept from its blocks' maxima and
masses alone where it can be, else its sum of exp and the mass above the first draw, in
one pass over its values), bound (a program a row: a
first draw kept, or where the search starts), fill (the values of a row drawn first and not
kept, which prepare stores only where they are more than logits / temperature: a plain
top-p row's 4 bytes a token are neither written nor read back), the search levels, gather,
select (a program a row: tau, and the token when it can), draw and finish (the rows left
to draw over the whole vocabulary; the counts update; the token's logprob), then for
logprob rows the top-N and rank (rows x splits, then a program a row). The search
levels, gather, draw and fill work for the few rows that need them: those rows are put on
work lists on the device, and each listed row gets an equal share of the launch's rows x
splits programs. Launch grids depend only on the shapes: the launches can be captured in
CUDA graphs. A batch without top-k, top-p or min-p launches only prepare, pick, select
and finish (and the logprob kernels); one with min-p but no top-k or top-p, no check, search
levels or gather.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from csrc_triton._interpret import jit_helpers, kernels_for

_first_max = jit_helpers("step_ops")._first_max  # (value, index) pairs: larger, then first

__all__ = ["sample_rows", "sampling_splits", "SLOT_INT_FIELDS", "SLOT_FLOAT_FIELDS",
           "FLAG_RANDOM", "FLAG_BIAS", "FLAG_PENALTY", "FLAG_BANS", "FLAG_LOGPROBS",
           "FLAG_TOP_K", "FLAG_TOP_P", "FLAG_MIN_P", "FLAG_GRAMMAR", "ROW_UPDATE_COUNTS",
           "ROW_MASK_SHIFT", "MAX_LOGPROBS", "DRAW_BLOCK", "FIRST_DRAWS",
           "GATHER_CAP", "COUNT_SHIFT", "PROMPT_BIT", "BAN_BIT"]

# A slot's int64 parameters: flags, top_k, seed, prompt length, min_tokens, logprobs N.
SLOT_INT_FIELDS = 8
# A slot's float32 parameters: temperature, top_p, min_p, repetition, frequency, presence.
SLOT_FLOAT_FIELDS = 8
FLAG_RANDOM = 1      # temperature > 0: drawn, not the argmax
FLAG_BIAS = 2        # logit_bias: the slot's dense bias row is added
FLAG_PENALTY = 4     # repetition / frequency / presence penalties
FLAG_BANS = 8        # min_tokens: its ban bits apply while the output is shorter
FLAG_LOGPROBS = 16   # logprobs asked: the token's logprob, rank and top-N
FLAG_TOP_K = 32
FLAG_TOP_P = 64
FLAG_MIN_P = 128
FLAG_GRAMMAR = 256   # structured outputs: a row may carry a token bitmask
# A row's flag: its drawn token is counted in its slot now (speculative rows are counted
# by the host once accepted).
ROW_UPDATE_COUNTS = 1
# A row's flags >> ROW_MASK_SHIFT: 1 + the row of the step's token bitmask [M, ceil(V/32)]
# int32 that allows its tokens (bit t % 32 of word t // 32); 0: no mask.
ROW_MASK_SHIFT = 2
# A slot's counts entry per token: (times in the output) << COUNT_SHIFT | BAN_BIT if
# min_tokens bans it | PROMPT_BIT if the prompt holds it.
COUNT_SHIFT = 2
PROMPT_BIT = 1
BAN_BIT = 2
MAX_LOGPROBS = 20
GATHER_CAP = 1024     # values gathered and sorted once the search interval is this small
_PIVOTS = 8           # a one-program search pass's pivots
_LEVEL_PIVOTS = 16    # a search level's (every split of the row at once)
# Search levels before the select kernel (which goes on alone, a row a program, if need be).
# Each narrows a row's interval ~17-fold; two left Gaussian logits of std 0.6-2 at 151,936
# tokens 1,300-1,700 values wide, over GATHER_CAP, so a row's one program went on reading the
# whole row by itself. A level with no row searching costs a launch of programs that return.
_LEVELS = 4
_BLOCK = 1024
DRAW_BLOCK = _BLOCK   # the first draw's blocks (see the module docstring)
_LP_BLOCK = 4096      # a logprobs program's share of a row (one block)
# Programs a row's splits aim at, per SM, in all. At 4, 256 rows of 151,936 tokens gave the
# prepare kernel about 6 programs (24 warps) an SM and 1.7 TB/s (too few loads in flight).
# On the H100 (bench/sampler_bench.py --programs-per-sm 4 8 16, 2026-12-05-h100-sampler-
# work-lists) 8 took 4-20% off every 256-row setting against 4; 16 a little more at 256
# rows but 7-14 us more at one row.
PROGRAMS_PER_SM = 8
# The gather's programs per row split: a top-k row's gather reads about a third of its
# blocks, each waited on in turn (a load, a count, an atomic slot): more programs, shorter
# waits. At 4 (against 1) top-k 50's gather took 98 -> 84 us at 256 rows on the H200
# (2026-12-05-h200-sampler-pipelined-loads).
_GATHER_SPREAD = 4
# Loads in flight in the loops over a row (prepare, check, the search levels): 3 stages
# (cp.async) took prepare 154 -> 144 us (temperature) and 116 -> 95 us (top-k) at 256 rows
# on the H200, same file.
_LOOP_STAGES = 3
_INT64_MAX = tl.constexpr(2 ** 63 - 1)
_NO_TAU = tl.constexpr(-2 ** 63)  # tau of a row drawn before any threshold was needed
# Philox streams (its third counter word): draws over a kept set (the gathered list, the
# whole row after a cut) take 0; the pick kernel's first draws take streams of their own, so
# a cut first draw and the draw that replaces it use independent numbers.
# First draw j (of FIRST_DRAWS) takes streams 1 + 2j (its token) and 2 + 2j (its block).
FIRST_DRAWS = 4

# Partial results of prepare, per (row, split), in a float32 [R, splits, 8] buffer: at
# part + 0 the maximum, + 1 the sum of exp (top-p's, or check's), + 2 the least finite
# value, + 3 the finite count, + 4 and + 5 the raw logits' maximum and sum of exp. The
# draw kernel's shares use the same buffer, a slot of 8 each.


@triton.jit
def _key(x):
    """Order-preserving int32 of float32 values: a < b as floats iff _key(a) < _key(b)."""
    b = x.to(tl.int32, bitcast=True)
    return tl.where(b >= 0, b, b ^ 0x7FFFFFFF)


@triton.jit
def _unkey(k):
    b = tl.where(k >= 0, k, k ^ 0x7FFFFFFF)
    return b.to(tl.float32, bitcast=True)


# Work lists: the rows that search, gather, and draw over the whole vocabulary. Few rows of a
# batch do, and a launch of rows x splits programs gave each only its own row's splits: one
# searching row of 256 then took a level 55 us on the H100, one program's serial pass. A
# listed row instead gets an equal share of all the launch's programs (see _share). Each
# list holds up to R rows, R = the batch's rows = every launch's first grid dimension; the
# fill list (rows whose values are to be stored) is the fourth.
_SEARCH, _GATHER, _DRAW = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
# The rows drawn first whose draw was not kept and whose values prepare did not store.
_FILL = tl.constexpr(3)


@triton.jit
def _append(lists_ptr, list_len_ptr, list_at_ptr, which, row):
    """Put `row` on list `which`, and its place on the list at list_at[which, row]."""
    R = tl.num_programs(0)
    j = tl.atomic_add(list_len_ptr + which, 1)
    tl.store(lists_ptr + which * R + j, row.to(tl.int32))
    tl.store(list_at_ptr + which * R + row, j)


@triton.jit
def _parts(listed, programs, V, PART_BLOCK: tl.constexpr):
    """(parts a listed row's vocabulary is cut into, each part's length) when `programs`
    programs share `listed` rows: the same for every row of the list, at least a block a
    part."""
    q = tl.minimum(programs // tl.maximum(listed, 1), tl.cdiv(V, PART_BLOCK))
    part_len = tl.cdiv(tl.cdiv(V, q), PART_BLOCK) * PART_BLOCK
    return q, part_len


@triton.jit
def _share(lists_ptr, list_len_ptr, which, V, PART_BLOCK: tl.constexpr):
    """This program's share of list `which` in a launch of any grid: (the row, or -1 for
    none; its partial's index j * parts + part; start, end of its vocabulary part)."""
    p = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    R = tl.num_programs(0)
    programs = R * tl.num_programs(1)
    listed = tl.load(list_len_ptr + which)
    q, part_len = _parts(listed, programs, V, PART_BLOCK)
    j = p // q
    row = tl.where(j < listed, tl.load(lists_ptr + which * R + tl.minimum(j, R - 1)), -1)
    start = (p % q) * part_len
    return row.to(tl.int64), p.to(tl.int64), start, tl.minimum(start + part_len, V)


@triton.jit
def _uniform(seed, token, position, stream=0):
    """U(0, 1) for each index (a token id, or a block's in a first draw) at this
    position: Philox output index % 4 of counter (index // 4, position, stream, 0), its top
    23 bits, centred: never 0 or 1."""
    c0 = (token // 4).to(tl.uint32)
    c1 = (token * 0 + position).to(tl.uint32)
    zero = c0 * 0
    r0, r1, r2, r3 = tl.philox(seed, c0, c1, zero + stream, zero)
    lane = token % 4
    r = tl.where(lane == 0, r0, tl.where(lane == 1, r1, tl.where(lane == 2, r2, r3)))
    return ((r >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)


# Compiled kernels make Gumbel noise with the SFU's lg2.approx (one instruction; libdevice's
# logf is ~30, and the noise of every token of a random row made the prepare kernel
# compute-bound). Near u = 1, where lg2.approx's absolute error would swamp -log(u) and
# the winning tokens' noise comes from, -log(u) = 2 atanh(s), s = (1 - u) / (1 + u),
# by its series: relative error under 2.2e-7 over every u the generator makes. The
# interpreter keeps tl.log, as the PyTorch mirror does.
_FAST_LOG = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") != "1")
_LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _lg2(x):
    return tl.inline_asm_elementwise("lg2.approx.f32 $0, $1;", "=r,r", [x],
                                     dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _noise(u):
    """Gumbel noise -log(-log(u))."""
    if _FAST_LOG:
        d = 1.0 - u  # exact for u >= 0.5
        s = d / (2.0 - d)
        s2 = s * s
        p = 1.0 / 13.0
        p = p * s2 + 1.0 / 11.0
        p = p * s2 + 1.0 / 9.0
        p = p * s2 + 1.0 / 7.0
        p = p * s2 + 1.0 / 5.0
        p = p * s2 + 1.0 / 3.0
        p = p * s2 + 1.0
        e = tl.where(u >= 0.5, 2.0 * s * p, -_lg2(u) * _LN2)
        return -_lg2(e) * _LN2
    else:
        return -tl.log(-tl.log(u))


@triton.jit
def _gumbel(seed, token, position, stream=0):
    return _noise(_uniform(seed, token, position, stream))


@triton.jit
def _uniform_block(seed, start, position, BLOCK: tl.constexpr, stream=0):
    """_uniform for the tokens start .. start + BLOCK (start a multiple of 4): one Philox
    call per 4 tokens, its outputs interleaved in token order."""
    c0 = (start // 4 + tl.arange(0, BLOCK // 4)).to(tl.uint32)
    c1 = (c0 * 0 + position).to(tl.uint32)
    zero = c0 * 0
    r0, r1, r2, r3 = tl.philox(seed, c0, c1, zero + stream, zero)
    r = tl.reshape(tl.join(tl.join(r0, r2), tl.join(r1, r3)), (BLOCK,))
    return ((r >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)


# ---- prepare ---------------------------------------------------------------------------

@triton.jit
def _row_setup(ints_ptr, floats_ptr, row_pos_ptr, row_flags_ptr, row, slot):
    """A row's processing inputs: flags, position, 1 / temperature, the three penalties,
    whether min_tokens still bans, its grammar bitmask row (1 + row, 0 for none) and seed."""
    flags = tl.load(ints_ptr + slot * 8)
    position = tl.load(row_pos_ptr + row)
    prompt_len = tl.load(ints_ptr + slot * 8 + 3)
    min_tokens = tl.load(ints_ptr + slot * 8 + 4)
    inv_t = tl.load(floats_ptr + slot * 8 + 6)  # 1 / temperature, rounded on the host
    rep = tl.load(floats_ptr + slot * 8 + 3)
    freq = tl.load(floats_ptr + slot * 8 + 4)
    pres = tl.load(floats_ptr + slot * 8 + 5)
    banning = ((flags & 8) != 0) & (position - prompt_len < min_tokens)
    # Only a FLAG_GRAMMAR slot has a bitmask row.
    mask_row = (tl.load(row_flags_ptr + row) >> 2).to(tl.int64) * ((flags & 256) != 0)
    seed = tl.load(ints_ptr + slot * 8 + 2)
    return flags, position, inv_t, rep, freq, pres, banning, mask_row, seed


@triton.jit
def _process(raw, offs, ok, row, slot, V, flags, rep, freq, pres, banning, mask_row,
             mask_ptr, mask_words, bias_ptr, counts_ptr, row_extra_ptr, KX: tl.constexpr):
    """A row's values at offs before temperature: the raw logits after the grammar mask,
    logit_bias, min_tokens' bans and the penalties (-inf past the vocabulary)."""
    x = raw
    if mask_row > 0:
        word = tl.load(mask_ptr + (mask_row - 1) * mask_words + offs // 32, mask=ok, other=0)
        x = tl.where(((word >> (offs % 32)) & 1) != 0, x, float("-inf"))
    if (flags & 2) != 0:
        x = x + tl.load(bias_ptr + slot * V + offs, mask=ok, other=0.0)
    penalized = (flags & 4) != 0
    if banning | penalized:
        c = tl.load(counts_ptr + slot * V + offs, mask=ok, other=0)
        if banning:
            x = tl.where((c & 2) != 0, float("-inf"), x)
        if penalized:
            times = c >> 2
            for j in tl.static_range(KX):
                extra = tl.load(row_extra_ptr + row * KX + j)
                times += tl.where(offs == extra, 1, 0)
            seen = ((c & 1) != 0) | (times > 0)
            x = tl.where(seen, tl.where(x > 0, x / rep, x * rep), x)
            x = x - freq * times.to(tl.float32) - pres * (times > 0).to(tl.float32)
    return tl.where(ok, x, float("-inf"))


@triton.jit
def _prepare_kernel(logits_ptr, stride_l, x_ptr, stride_x, counts_ptr, bias_ptr, V,
                    row_slot_ptr, row_pos_ptr, row_extra_ptr, row_flags_ptr, mask_ptr,
                    mask_words, ints_ptr, floats_ptr, part_ptr, part_idx_ptr, block_max_ptr,
                    block_lse_ptr, num_blocks, split_len, list_len_ptr, raw_scale_ptr,
                    KX: tl.constexpr, BLOCK: tl.constexpr, STAGES: tl.constexpr):
    """Program (row, split): the row's values over its split of the vocabulary, processed
    (grammar mask, bias, bans, penalties, temperature); partial maximum, first argmax,
    sum of exp (relative to that maximum), least finite value and finite count; the raw
    logits' maximum and sum of exp for a logprob row. A random row drawn first (no top-k)
    gets each block's log-sum-exp, from which the pick kernel draws. Truncated random
    rows store x (unless the later kernels can remake it from the logits) and each
    block's maximum (their bound, see _bound_kernel)."""
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    num_splits = tl.num_programs(1)
    if (row == 0) & (split == 0):  # the work lists start empty (the later kernels fill them)
        tl.store(list_len_ptr + tl.arange(0, 4), tl.zeros((4,), dtype=tl.int32))
    slot = tl.load(row_slot_ptr + row).to(tl.int64)
    part = part_ptr + (row * num_splits + split) * 8
    if slot < 0:
        return
    flags, position, inv_t, rep, freq, pres, banning, mask_row, seed = _row_setup(
        ints_ptr, floats_ptr, row_pos_ptr, row_flags_ptr, row, slot)
    if flags == 0:
        return  # plain greedy: the step's own argmax stands
    random = (flags & 1) != 0
    want_lp = (flags & 16) != 0
    top_p_on = (flags & 64) != 0
    drawn_here = random & ((flags & 224) == 0)   # no top-k, top-p or min-p
    drawn_first = random & ((flags & 32) == 0) & ((flags & 192) != 0)  # checked after
    # A top-k row's block maxima (and top-p's sum of exp) are made here; a row drawn first
    # stores its block maxima beside its blocks' log-sum-exp, and a top-p one gets its sum
    # of exp from the check kernel's pass.
    maxima_here = ((flags & 96) != 0) & (drawn_first == 0)
    # x is stored for the kernels after this one, unless they can remake it from the raw
    # logits: a row drawn first whose values are its logits / temperature (the check
    # kernel reads the logits then; the fill kernel stores x if the draw is not kept).
    processed = (mask_row > 0) | ((flags & 6) != 0) | banning
    stores_x = random & (drawn_here == 0) & (processed | (drawn_first == 0))
    if split == 0:
        tl.store(raw_scale_ptr + row, tl.where(stores_x, 0.0, inv_t))

    lanes = tl.arange(0, BLOCK)
    best = tl.full((BLOCK,), float("-inf"), dtype=tl.float32)
    best_at = lanes
    # Top-p's sum of exp per lane, relative to the split's running maximum (run_max). Per
    # lane and relative to the lane's own maximum (one exp a value, no wait on the block's
    # maximum, more arithmetic) was slower: prepare 195.6 -> 205.2 us at 256 rows on an
    # H100 (2026-12-05-h100-sampler-min-p-graph).
    run_max = float("-inf")
    run_sum = tl.zeros((BLOCK,), dtype=tl.float32)
    least = tl.full((BLOCK,), float("inf"), dtype=tl.float32)  # per lane, reduced once
    finite = tl.zeros((BLOCK,), dtype=tl.int32)
    raw_max = float("-inf")
    raw_sum = 0.0
    start = split * split_len
    for k in tl.range(start, tl.minimum(start + split_len, V), BLOCK, num_stages=STAGES):
        offs = k + lanes
        ok = offs < V
        raw = tl.load(logits_ptr + row * stride_l + offs, mask=ok,
                      other=float("-inf")).to(tl.float32)
        if want_lp:
            bm = tl.max(raw, 0)
            new = tl.maximum(raw_max, bm)
            raw_sum = raw_sum * tl.exp(raw_max - new) + tl.sum(tl.exp(raw - new), 0)
            raw_max = new
        x = _process(raw, offs, ok, row, slot, V, flags, rep, freq, pres, banning, mask_row,
                     mask_ptr, mask_words, bias_ptr, counts_ptr, row_extra_ptr, KX)
        if random:
            x = x * inv_t
            if drawn_here | drawn_first:
                # The block's log-sum-exp, relative to its own maximum: the same value
                # whatever the split, so the draw is the same in any batch.
                bm = tl.max(x, 0)
                some = bm > float("-inf")
                mass = tl.sum(tl.exp(x - tl.where(some, bm, 0.0)), 0)  # exp(-inf) = 0
                tl.store(block_lse_ptr + row * num_blocks + k // BLOCK,
                         tl.where(some, bm + tl.log(tl.where(some, mass, 1.0)),
                                  float("-inf")))
                if drawn_first:  # its bound, and the check kernel's shortcut
                    tl.store(block_max_ptr + row * num_blocks + k // BLOCK, bm)
            if stores_x:
                tl.store(x_ptr + row * stride_x + offs, x, mask=ok)
            if maxima_here:
                bm = tl.max(x, 0)
                tl.store(block_max_ptr + row * num_blocks + k // BLOCK, bm)
                if top_p_on:
                    new = tl.maximum(run_max, bm)
                    if new > float("-inf"):
                        run_sum = run_sum * tl.exp(run_max - new) + tl.exp(x - new)
                    run_max = new
            if not drawn_here:
                fin = x > float("-inf")
                least = tl.minimum(least, tl.where(fin, x, float("inf")))
                finite += fin.to(tl.int32)
        take = x > best
        best = tl.where(take, x, best)
        best_at = tl.where(take, offs, best_at)
    v, i = tl.reduce((best, best_at), 0, _first_max)
    tl.store(part + 0, v)
    tl.store(part + 1, tl.sum(run_sum, 0))
    tl.store(part + 2, tl.min(least, 0))
    tl.store(part + 3, tl.sum(finite, 0).to(tl.float32))
    tl.store(part + 4, raw_max)
    tl.store(part + 5, raw_sum)
    tl.store(part_idx_ptr + row * num_splits + split, i)


# ---- pick: the first draw of a row without top-k ---------------------------------------

@triton.jit
def _pick_kernel(logits_ptr, stride_l, counts_ptr, bias_ptr, V, row_slot_ptr, row_pos_ptr,
                 row_extra_ptr, row_flags_ptr, mask_ptr, mask_words, ints_ptr, floats_ptr,
                 block_lse_ptr, num_blocks, token_ptr, first_ptr, KX: tl.constexpr,
                 BLOCK: tl.constexpr,
                 BLOCKS_P2: tl.constexpr, DRAWS: tl.constexpr):
    """Program row, for a random row without top-k: tokens drawn over every token in two
    stages, a block with probability its share of the row's mass (Gumbel-max over the
    blocks' log-sum-exp, prepare's), then a token of that block by its share of the
    block's (Gumbel-max over the block's values, remade here): exp(x_i) / sum exp(x)
    for token i, as one Gumbel-max over the whole row would draw, with noise for one
    block of tokens instead of every token (prepare's pass is then bound by its loads,
    not by Philox). A row without truncation draws once (its token, at token_ptr); a
    top-p or min-p row draws DRAWS times, independently (first_ptr[row, j]), and the
    bound kernel keeps the first of them that its truncation keeps."""
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(row_slot_ptr + row).to(tl.int64)
    if slot < 0:
        return
    flags, position, inv_t, rep, freq, pres, banning, mask_row, seed = _row_setup(
        ints_ptr, floats_ptr, row_pos_ptr, row_flags_ptr, row, slot)
    if ((flags & 1) == 0) | ((flags & 32) != 0):
        return  # greedy, or top-k: drawn after its threshold
    draws = tl.where((flags & 192) != 0, DRAWS, 1)
    b = tl.arange(0, BLOCKS_P2)
    lse = tl.load(block_lse_ptr + row * num_blocks + b, mask=b < num_blocks,
                  other=float("-inf"))
    for j in tl.static_range(DRAWS):
        if j < draws:
            score = tl.where(lse > float("-inf"), lse + _gumbel(seed, b, position, 2 + 2 * j),
                             float("-inf"))
            _, chosen = tl.reduce((score, b), 0, _first_max)
            start = chosen * BLOCK
            offs = start + tl.arange(0, BLOCK)
            ok = offs < V
            raw = tl.load(logits_ptr + row * stride_l + offs, mask=ok,
                          other=float("-inf")).to(tl.float32)
            x = _process(raw, offs, ok, row, slot, V, flags, rep, freq, pres, banning,
                         mask_row, mask_ptr, mask_words, bias_ptr, counts_ptr, row_extra_ptr,
                         KX) * inv_t
            noise = _noise(_uniform_block(seed, start, position, BLOCK, 1 + 2 * j))
            score = tl.where(x > float("-inf"), x + noise, float("-inf"))
            _, token = tl.reduce((score, offs), 0, _first_max)
            token = tl.minimum(token, V - 1).to(tl.int64)
            tl.store(first_ptr + row * DRAWS + j, token)
            if j == 0:
                tl.store(token_ptr + row, token)


# ---- select: the threshold search ------------------------------------------------------

@triton.jit
def _above(x_row, start, end, pivots, peak, USE_MASS: tl.constexpr, NP: tl.constexpr,
           BLOCK: tl.constexpr, STAGES: tl.constexpr = 1):
    """For each pivot key: how many values of x_row[start:end] have a larger key, and
    their sum of exp(x - peak) (zeros unless USE_MASS). Sums per lane, reduced once at
    the end: a reduction per block would cost one program more than its loads."""
    piv = pivots.to(tl.int32)[:, None]
    count = tl.zeros((NP, BLOCK), dtype=tl.int32)
    mass = tl.zeros((NP, BLOCK), dtype=tl.float32)
    V = end
    for k in tl.range(start, end, BLOCK, num_stages=STAGES):
        offs = k + tl.arange(0, BLOCK)
        x = tl.load(x_row + offs, mask=offs < V, other=float("-inf"))
        above = _key(x)[None, :] > piv
        count += above.to(tl.int32)
        if USE_MASS:
            mass += tl.where(above, tl.exp(x - peak)[None, :], 0.0)
    return tl.sum(count, 1), tl.sum(mass, 1)


@triton.jit
def _pivots(lo, hi, NP: tl.constexpr):
    """NP strictly increasing keys inside (lo, hi), evenly spaced in value (a few ulps
    apart: consecutive keys)."""
    j = tl.arange(0, NP)
    lo_v = _unkey(lo.to(tl.int32))
    hi_v = _unkey(hi.to(tl.int32))
    frac = (j + 1).to(tl.float32) / (NP + 1)
    guess = _key(lo_v + (hi_v - lo_v) * frac).to(tl.int64)
    pivots = tl.minimum(tl.maximum(guess, lo + j + 1), hi - NP + j)
    return tl.where(hi - lo > NP, pivots, tl.minimum(lo + j + 1, hi - 1))


@triton.jit
def _narrow(pivots, count, f, limit, lo, hi, count_lo, count_hi, f_hi, NP: tl.constexpr):
    """The search interval after a pass over the pivots: lo moves to the last pivot
    whose f (count or mass above it) reaches limit, hi to the first that stays under."""
    j = tl.arange(0, NP)
    short = tl.sum((f >= limit).to(tl.int32), 0)  # pivots below tau
    if short > 0:
        pick = j == short - 1
        lo = tl.sum(tl.where(pick, pivots, 0), 0)
        count_lo = tl.sum(tl.where(pick, count, 0), 0)
    if short < NP:
        pick = j == short
        hi = tl.sum(tl.where(pick, pivots, 0), 0)
        count_hi = tl.sum(tl.where(pick, count, 0), 0)
        f_hi = tl.sum(tl.where(pick, f, 0.0), 0)
    return lo, hi, count_lo, count_hi, f_hi


@triton.jit
def _search(x_row, V, lo, hi, count_lo, count_hi, f_hi, limit, peak,
            USE_MASS: tl.constexpr, NP: tl.constexpr, BLOCK: tl.constexpr,
            CAP: tl.constexpr):
    """Narrow (lo, hi] around tau = the least key t with f(t) < limit, where f(t) is the
    count (or mass) of values with a key above t; f(lo) >= limit > f(hi). Stops when the
    interval holds at most CAP values or a single key. count_* are the counts of values
    above lo and hi, f_hi the count or mass above hi. One program: the search levels
    (_level_kernel) do the same passes with every split of the row at once."""
    while (count_lo - count_hi > CAP) & (hi - lo > 1):
        pivots = _pivots(lo, hi, NP)
        count, mass = _above(x_row, 0, V, pivots, peak, USE_MASS, NP, BLOCK)
        if USE_MASS:
            f = mass
        else:
            f = count.to(tl.float32)
        lo, hi, count_lo, count_hi, f_hi = _narrow(pivots, count, f, limit, lo, hi,
                                                   count_lo, count_hi, f_hi, NP)
    return lo, hi, count_lo, count_hi, f_hi


@triton.jit
def _gather(x_row, V, lo, hi, g_val, g_idx, BLOCK: tl.constexpr):
    """Copy the values with lo < key <= hi, and their token ids, to g_val / g_idx."""
    n = 0
    for k in range(0, V, BLOCK):
        offs = k + tl.arange(0, BLOCK)
        x = tl.load(x_row + offs, mask=offs < V, other=float("-inf"))
        key = _key(x).to(tl.int64)
        take = (key > lo) & (key <= hi) & (offs < V)
        found = tl.sum(take.to(tl.int32), 0)
        if found > 0:  # most blocks hold none: no scan for them
            at = n + tl.cumsum(take.to(tl.int32), 0) - 1
            tl.store(g_val + at, x, mask=take)
            tl.store(g_idx + at, offs, mask=take)
            n += found
    tl.debug_barrier()  # the program reads them back in other lanes
    return n


@triton.jit
def _sorted_gathered(g_val, g_idx, n, CAP: tl.constexpr):
    """The gathered values' keys and token ids, largest value first (ties: larger id
    first); lanes past n hold the least key."""
    i = tl.arange(0, CAP)
    ok = i < n
    key = _key(tl.load(g_val + i, mask=ok, other=float("-inf"))).to(tl.int64)
    ids = tl.load(g_idx + i, mask=ok, other=0).to(tl.int64)
    packed = tl.where(ok, (key << 32) | ids, -_INT64_MAX - 1)
    packed = tl.sort(packed, 0, descending=True)
    return (packed >> 32).to(tl.int32), (packed & 0xFFFFFFFF).to(tl.int32), ok


@triton.jit
def _boundary(keys, ok, f_above, limit, floor, peak, USE_MASS: tl.constexpr,
              CAP: tl.constexpr):
    """Of sorted keys (those at or above `floor` count): the least key whose values
    above it (f_above plus the earlier entries) stay under limit; the count of entries
    at or above it; the total weight at or above floor (f_above included)."""
    i = tl.arange(0, CAP)
    inside = ok & (keys.to(tl.int64) >= floor)
    if USE_MASS:
        w = tl.where(inside, tl.exp(_unkey(keys) - peak), 0.0)
    else:
        w = inside.to(tl.float32)
    total = tl.cumsum(w, 0)
    before = f_above + total - w
    kept = inside & (before < limit)
    last = tl.max(tl.where(kept, i, -1), 0)
    tau = tl.sum(tl.where(i == last, keys, 0), 0).to(tl.int64)
    at_or_above = tl.sum((inside & (keys.to(tl.int64) >= tau)).to(tl.int32), 0)
    return tau, at_or_above, f_above + tl.max(total, 0)


@triton.jit
def _combined(part_ptr, part_idx_ptr, row, num_splits, SPLITS_P2: tl.constexpr):
    """prepare's partials of a row: (maximum, its first index, sum of exp(x - maximum),
    least finite value, finite count)."""
    s = tl.arange(0, SPLITS_P2)
    in_row = s < num_splits
    part = part_ptr + (row * num_splits + s) * 8
    maxes = tl.load(part + 0, mask=in_row, other=float("-inf"))
    peak = tl.max(maxes, 0)
    first = tl.min(tl.where(maxes == peak, s, SPLITS_P2), 0)
    argmax = tl.load(part_idx_ptr + row * num_splits + first)
    sums = tl.load(part + 1, mask=in_row, other=0.0)
    total = tl.sum(tl.where(maxes > float("-inf"), sums * tl.exp(maxes - peak), 0.0), 0)
    least = tl.min(tl.load(part + 2, mask=in_row, other=float("inf")), 0)
    finite = tl.sum(tl.load(part + 3, mask=in_row, other=0.0), 0).to(tl.int32)
    return peak, argmax, total, least, finite


@triton.jit
def _values(x_row, logits_row, offs, V, scale):
    """A random row's values at offs: those prepare stored in x (scale 0), else remade
    from the raw logits with prepare's arithmetic (scale: 1 / temperature)."""
    if scale == 0.0:
        x = tl.load(x_row + offs, mask=offs < V, other=float("-inf"))
    else:
        raw = tl.load(logits_row + offs, mask=offs < V, other=float("-inf"))
        x = raw.to(tl.float32) * scale
    return x


@triton.jit
def _share_peak(block_max_row, start, end, BLOCK: tl.constexpr, BLOCKS_P2: tl.constexpr):
    """The largest block maximum over [start, end) (block-aligned start): one vector load,
    so that a share with no block to read returns at once instead of waiting on a scalar
    load per block."""
    b = tl.arange(0, BLOCKS_P2)
    first = start // BLOCK
    maxima = tl.load(block_max_row + first + b, mask=b < tl.cdiv(end - start, BLOCK),
                     other=float("-inf"))
    return tl.max(maxima, 0)


@triton.jit
def _split_sums(row_ptr, scale, start, end, V, drawn, top, BLOCK: tl.constexpr,
                STAGES: tl.constexpr):
    """Over the values x = row * scale in [start, end): the sum of exp(x - top), and that
    sum over the values above each of `drawn` (a vector)."""
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    above = tl.zeros((drawn.shape[0], BLOCK), dtype=tl.float32)
    for k in tl.range(start, end, BLOCK, num_stages=STAGES):
        offs = k + tl.arange(0, BLOCK)
        x = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32) * scale
        e = tl.where(x > float("-inf"), tl.exp(x - top), 0.0)
        total += e
        above += tl.where(x[None, :] > drawn[:, None], e[None, :], 0.0)
    return tl.sum(total, 0), tl.sum(above, 1)


@triton.jit
def _check_kernel(x_ptr, stride_x, logits_ptr, stride_l, V, row_slot_ptr, ints_ptr,
                  floats_ptr, part_ptr, raw_scale_ptr, block_max_ptr, block_lse_ptr,
                  num_blocks, mass_ptr, split_len, first_ptr, SPLITS_P2: tl.constexpr,
                  BLOCKS_P2: tl.constexpr, NP: tl.constexpr, BLOCK: tl.constexpr,
                  STAGES: tl.constexpr, DRAWS: tl.constexpr):
    """Program (row, split) of a top-p row drawn first (no top-k): which of the pick
    kernel's draws does top-p keep? First from prepare's blocks: the mass above the first
    draw's value is at most that of the blocks whose maximum is above it; where that is
    under top_p of the row's, the first draw is kept (a peaked row of a trained model:
    most of its mass in the drawn token's few blocks, or nothing above its top token).
    Else one pass over the split's values (remade from the logits, or as prepare stored
    them): the split's sum of exp (its partial, relative to the split's maximum) and the
    mass of the values strictly above each draw's, at mass_ptr[(row, split) * NP + j],
    relative to the row's maximum."""
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    num_splits = tl.num_programs(1)
    slot = tl.load(row_slot_ptr + row).to(tl.int64)
    if slot < 0:
        return
    flags = tl.load(ints_ptr + slot * 8)
    if ((flags & 1) == 0) | ((flags & 32) != 0) | ((flags & 64) == 0):
        return
    # The row's maximum from the splits' maxima alone (not _combined: the sums beside them
    # are what this launch's programs write).
    s = tl.arange(0, SPLITS_P2)
    peak = tl.max(tl.load(part_ptr + (row * num_splits + s) * 8, mask=s < num_splits,
                          other=float("-inf")), 0)
    scale = tl.load(raw_scale_ptr + row)
    x_row = x_ptr + row * stride_x
    logits_row = logits_ptr + row * stride_l
    j = tl.arange(0, DRAWS)
    drawn = _values(x_row, logits_row, tl.load(first_ptr + row * DRAWS + j), V, scale)
    first = tl.max(tl.where(j == 0, drawn, float("-inf")), 0)
    part = part_ptr + (row * num_splits + split) * 8
    mass = mass_ptr + (row * num_splits + split) * NP + j
    b = tl.arange(0, BLOCKS_P2)
    in_row = b < num_blocks
    lse = tl.load(block_lse_ptr + row * num_blocks + b, mask=in_row, other=float("-inf"))
    maxima = tl.load(block_max_ptr + row * num_blocks + b, mask=in_row, other=float("-inf"))
    w = tl.where(lse > float("-inf"), tl.exp(lse - peak), 0.0)
    most = tl.sum(tl.where(maxima > first, w, 0.0), 0)
    # A margin for the rounding of two ways to sum the row's mass.
    if most < tl.load(floats_ptr + slot * 8 + 1) * tl.sum(w, 0) * (1.0 - 1e-5):
        tl.store(part + 1, 1.0)  # the bound kernel needs only a positive total
        # The first draw kept by top-p; the others unread unless min-p cuts it: then cut.
        tl.store(mass, tl.where(j == 0, 0.0, float("inf")))
        return
    top = tl.load(part + 0)  # the split's maximum (prepare's)
    start = split * split_len
    end = tl.minimum(start + split_len, V)
    if scale == 0.0:
        total, above = _split_sums(x_row, 1.0, start, end, V, drawn, top, BLOCK, STAGES)
    else:
        total, above = _split_sums(logits_row, scale, start, end, V, drawn, top, BLOCK,
                                   STAGES)
    tl.store(part + 1, total)
    tl.store(mass, tl.where(top > float("-inf"), above * tl.exp(top - peak), 0.0))


@triton.jit
def _bound_kernel(x_ptr, stride_x, logits_ptr, stride_l, V, row_slot_ptr, ints_ptr,
                  floats_ptr, part_ptr, part_idx_ptr, raw_scale_ptr, num_splits,
                  block_max_ptr, num_blocks, lo_ptr, hi_ptr,
                  count_ptr, peak_ptr, state_ptr, state_f_ptr, pivots_ptr, mass_ptr,
                  token_ptr, tau_ptr, lists_ptr, list_len_ptr, list_at_ptr, first_ptr,
                  SPLITS_P2: tl.constexpr, BLOCKS_P2: tl.constexpr,
                  NP: tl.constexpr, CAP: tl.constexpr, DRAWS: tl.constexpr):
    """Program row, for a truncated random row: a value every kept token reaches, from
    the blocks' maxima (each block holds a value at least its maximum): the k-th largest
    block maximum for top-k; for top-p without a top-k cut, the largest block maximum
    down to which the maxima alone hold top_p of the row's mass. Its key goes to lo (the
    gather takes keys in [lo, hi]), the gather's count to zero. A row without a bound
    starts the search levels instead (state: lo, hi, count above each, mode, active; f
    above hi, limit; the first pivots): mode 1 top-k's count, 2 top-p's mass (top-k off).
    First, a row drawn first (top-p or min-p, no top-k): its token when kept (then
    nothing else runs for it; its tau is _NO_TAU), else -1 (and onto the fill list if
    prepare did not store its values)."""
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(row_slot_ptr + row).to(tl.int64)
    if slot < 0:
        return
    state = state_ptr + row * 6
    tl.store(state + 5, 0)  # not searching
    flags = tl.load(ints_ptr + slot * 8)
    if ((flags & 1) == 0) | ((flags & 224) == 0):
        return  # greedy, or random without truncation: nothing to bound
    peak, _, total, least, finite = _combined(part_ptr, part_idx_ptr, row, num_splits,
                                              SPLITS_P2)
    if (flags & 32) == 0:  # top-p or min-p without top-k: drawn first, DRAWS times
        j = tl.arange(0, DRAWS)
        tokens = tl.load(first_ptr + row * DRAWS + j)  # the pick kernel's
        scale = tl.load(raw_scale_ptr + row)
        drawn = _values(x_ptr + row * stride_x, logits_ptr + row * stride_l, tokens, V,
                        scale)
        kept = drawn > float("-inf")
        if (flags & 64) != 0:
            s = tl.arange(0, SPLITS_P2)
            at = (row * num_splits + s)[:, None] * NP + j[None, :]
            above = tl.sum(tl.load(mass_ptr + at, mask=(s < num_splits)[:, None],
                                   other=0.0), 0)
            kept = kept & (above < tl.load(floats_ptr + slot * 8 + 1) * total)
        if (flags & 128) != 0:
            kept = kept & (tl.exp(drawn - peak) >= tl.load(floats_ptr + slot * 8 + 2))
        # The first kept draw: a draw of the kept set, by rejection.
        pick = tl.min(tl.where(kept, j, DRAWS), 0)
        kept = pick < DRAWS
        token = tl.sum(tl.where(j == pick, tokens, 0), 0)
        tl.store(token_ptr + row, tl.where(kept, token, -1))
        if (kept == 0) & (scale != 0.0):
            _append(lists_ptr, list_len_ptr, list_at_ptr, _FILL, row)
        if kept:
            tl.store(lo_ptr + row, _INT64_MAX)  # the gather takes nothing
            tl.store(tau_ptr + row, _NO_TAU)
            return
    if (flags & 96) == 0:
        return  # min-p alone: no threshold to search
    tl.store(count_ptr + row, 0)
    tl.store(state + 4, 0)  # mode: none
    tl.store(hi_ptr + row, _INT64_MAX)
    tl.store(peak_ptr + row, peak)
    b = tl.arange(0, BLOCKS_P2)
    maxima = tl.load(block_max_ptr + row * num_blocks + b, mask=b < num_blocks,
                     other=float("-inf"))
    maxima = tl.sort(maxima, 0, descending=True)
    bound = float("-inf")
    top_k = tl.load(ints_ptr + slot * 8 + 1)
    if ((flags & 32) != 0) & (top_k <= num_blocks):
        bound = tl.sum(tl.where(b == top_k - 1, maxima, 0.0), 0)
    # Top-p's bound from the row's whole mass holds only where top-k cuts nothing: after
    # a cut, top-p's share is of the mass top-k kept, read from top-k's gathered set.
    if ((flags & 64) != 0) & (((flags & 32) == 0) | (top_k >= finite)):
        w = tl.where(maxima > float("-inf"), tl.exp(maxima - peak), 0.0)
        enough = tl.cumsum(w, 0) >= tl.load(floats_ptr + slot * 8 + 1) * total
        first = tl.min(tl.where(enough, b, BLOCKS_P2), 0)
        if first < BLOCKS_P2:
            bound = tl.maximum(bound, tl.sum(tl.where(b == first, maxima, 0.0), 0))
    bounded = (bound > float("-inf")) | (finite <= CAP)
    tl.store(lo_ptr + row, tl.where(bounded, _key(bound).to(tl.int64), _INT64_MAX))
    if bounded:
        _append(lists_ptr, list_len_ptr, list_at_ptr, _GATHER, row)
    else:
        _append(lists_ptr, list_len_ptr, list_at_ptr, _SEARCH, row)
        lo = _key(least).to(tl.int64) - 1
        hi = _key(peak).to(tl.int64)
        if ((flags & 32) != 0) & (top_k < finite):
            mode = finite * 0 + 1
            limit = top_k.to(tl.float32)
        else:
            mode = finite * 0 + 2
            limit = tl.load(floats_ptr + slot * 8 + 1) * total
        tl.store(state + 0, lo)
        tl.store(state + 1, hi)
        tl.store(state + 2, finite.to(tl.int64))
        tl.store(state + 3, 0)
        tl.store(state + 4, mode)
        tl.store(state + 5, 1)
        tl.store(state_f_ptr + row * 2, 0.0)
        tl.store(state_f_ptr + row * 2 + 1, limit)
        tl.store(pivots_ptr + row * NP + tl.arange(0, NP), _pivots(lo, hi, NP))


@triton.jit
def _fill_kernel(logits_ptr, stride_l, x_ptr, stride_x, V, raw_scale_ptr, lists_ptr,
                 list_len_ptr, BLOCK: tl.constexpr):
    """A share (_share) of a row on the fill list: its values stored, as prepare would
    have, for the search, gather and draw that follow."""
    row, _, start, end = _share(lists_ptr, list_len_ptr, _FILL, V, BLOCK)
    if row < 0:
        return
    scale = tl.load(raw_scale_ptr + row)
    for k in range(start, end, BLOCK):
        offs = k + tl.arange(0, BLOCK)
        x = _values(x_ptr + row * stride_x, logits_ptr + row * stride_l, offs, V, scale)
        tl.store(x_ptr + row * stride_x + offs, x, mask=offs < V)


@triton.jit
def _gather_kernel(x_ptr, stride_x, V, lo_ptr, hi_ptr, count_ptr, g_val_ptr, g_idx_ptr,
                   block_max_ptr, num_blocks, lists_ptr, list_len_ptr, CAP: tl.constexpr,
                   BLOCKS_P2: tl.constexpr, BLOCK: tl.constexpr):
    """A share (_share) of a row on the gather list (bounded, or its search levels ended):
    its values with a key in [lo, hi], and their token ids, appended to the row's list
    (slots by an atomic count; the list is sorted after, so the order they land in does
    not matter); past CAP only counted. Blocks whose maximum is under lo hold none and
    are not read: a top-k row bounded by its k-th largest block maximum reads k blocks."""
    row, _, start, end = _share(lists_ptr, list_len_ptr, _GATHER, V, BLOCK)
    if row < 0:
        return
    lo = tl.load(lo_ptr + row)
    hi = tl.load(hi_ptr + row)
    if _key(_share_peak(block_max_ptr + row * num_blocks, start, end, BLOCK,
                        BLOCKS_P2)).to(tl.int64) < lo:
        return
    for k in range(start, end, BLOCK):
        if _key(tl.load(block_max_ptr + row * num_blocks + k // BLOCK)).to(tl.int64) >= lo:
            offs = k + tl.arange(0, BLOCK)
            x = tl.load(x_ptr + row * stride_x + offs, mask=offs < V, other=float("-inf"))
            key = _key(x).to(tl.int64)
            take = (key >= lo) & (key <= hi) & (offs < V)
            n = tl.sum(take.to(tl.int32), 0)
            if n > 0:
                base = tl.atomic_add(count_ptr + row, n)
                at = base + tl.cumsum(take.to(tl.int32), 0) - 1
                keep = take & (at < CAP)
                tl.store(g_val_ptr + row * CAP + at, x, mask=keep)
                tl.store(g_idx_ptr + row * CAP + at, offs, mask=keep)


@triton.jit
def _level_kernel(x_ptr, stride_x, V, state_ptr, pivots_ptr, peak_ptr, level_count_ptr,
                  level_mass_ptr, lists_ptr, list_len_ptr, NP: tl.constexpr,
                  PART_BLOCK: tl.constexpr, BLOCK: tl.constexpr, STAGES: tl.constexpr):
    """A share (_share) of a row on the search list, while it searches: its part's count
    (and, for top-p, mass) of values above each pivot; _narrow_kernel adds the parts up."""
    row, at, start, end = _share(lists_ptr, list_len_ptr, _SEARCH, V, PART_BLOCK)
    if row < 0:
        return
    state = state_ptr + row * 6
    if tl.load(state + 5) == 0:
        return
    j = tl.arange(0, NP)
    pivots = tl.load(pivots_ptr + row * NP + j)
    peak = tl.load(peak_ptr + row)
    x_row = x_ptr + row * stride_x
    if tl.load(state + 4) == 2:
        count, mass = _above(x_row, start, end, pivots, peak, True, NP, BLOCK, STAGES)
    else:
        count, mass = _above(x_row, start, end, pivots, peak, False, NP, BLOCK, STAGES)
    out = at * NP + j
    tl.store(level_count_ptr + out, count)
    tl.store(level_mass_ptr + out, mass)


@triton.jit
def _narrow_kernel(row_slot_ptr, state_ptr, state_f_ptr, pivots_ptr, level_count_ptr,
                   level_mass_ptr, programs, V, lo_ptr, hi_ptr, lists_ptr, list_len_ptr,
                   list_at_ptr, NP: tl.constexpr, CAP: tl.constexpr,
                   PART_BLOCK: tl.constexpr):
    """Program row of a searching row: its parts' counts added up, the interval
    narrowed (_narrow); done once it holds at most CAP values (onto the gather list,
    which takes them: all above lo if that is at most CAP, else those in (lo, hi]) or one
    key; else the next pivots. `programs`: the level kernel's."""
    row = tl.program_id(0).to(tl.int64)
    if tl.load(row_slot_ptr + row) < 0:
        return
    state = state_ptr + row * 6
    if tl.load(state + 5) == 0:
        return
    j = tl.arange(0, NP)
    by_mass = tl.load(state + 4) == 2
    count = tl.zeros((NP,), dtype=tl.int32)
    f = tl.zeros((NP,), dtype=tl.float32)
    parts, _ = _parts(tl.load(list_len_ptr + _SEARCH), programs, V, PART_BLOCK)
    first = tl.load(list_at_ptr + _SEARCH * tl.num_programs(0) + row) * parts
    for s0 in range(0, parts, 16):  # 16 parts at a time: one variant for any count
        s = s0 + tl.arange(0, 16)
        at = (first + s[:, None]) * NP + j[None, :]
        ok = (s < parts)[:, None]
        count += tl.sum(tl.load(level_count_ptr + at, mask=ok, other=0), 0)
        if by_mass:
            f += tl.sum(tl.load(level_mass_ptr + at, mask=ok, other=0.0), 0)
    if not by_mass:
        f = count.to(tl.float32)
    pivots = tl.load(pivots_ptr + row * NP + j)
    lo, hi, count_lo, count_hi, f_hi = _narrow(
        pivots, count, f, tl.load(state_f_ptr + row * 2 + 1), tl.load(state + 0),
        tl.load(state + 1), tl.load(state + 2).to(tl.int32), tl.load(state + 3).to(tl.int32),
        tl.load(state_f_ptr + row * 2), NP)
    tl.store(state + 0, lo)
    tl.store(state + 1, hi)
    tl.store(state + 2, count_lo.to(tl.int64))
    tl.store(state + 3, count_hi.to(tl.int64))
    tl.store(state_f_ptr + row * 2, f_hi)
    if hi - lo <= 1:
        tl.store(state + 5, 0)
    elif count_lo - count_hi <= CAP:
        tl.store(state + 5, 0)
        tl.store(lo_ptr + row, lo + 1)
        tl.store(hi_ptr + row, tl.where(count_lo <= CAP, _INT64_MAX, hi))
        _append(lists_ptr, list_len_ptr, list_at_ptr, _GATHER, row)
    else:
        tl.store(pivots_ptr + row * NP + j, _pivots(lo, hi, NP))


@triton.jit
def _phase(x_row, V, lo, hi, count_lo, count_hi, f_hi, limit, peak, gathered, listed,
           listed_lo, g_val, g_idx, USE_MASS: tl.constexpr, NP: tl.constexpr,
           BLOCK: tl.constexpr, CAP: tl.constexpr):
    """One truncation's tau in one program, from a search state (lo, hi, ...): search on,
    then the interval's values gathered (`gathered`: the gather kernel already took them,
    `listed` of them, if the search had nothing left to do), sorted, the boundary read.
    Returns (tau, values at or above it, the key above which the list holds every value
    (else the one passed in), the list's length)."""
    lo1, hi1, count_lo, count_hi, f_hi = _search(x_row, V, lo, hi, count_lo, count_hi,
                                                 f_hi, limit, peak, USE_MASS, NP, BLOCK, CAP)
    if hi1 - lo1 <= 1:
        tau = hi1
        at_tau = count_lo
    else:
        everything = count_lo <= CAP
        if (gathered == 0) | (lo1 != lo) | (hi1 != hi):
            listed = _gather(x_row, V, lo1, tl.where(everything, _INT64_MAX, hi1), g_val,
                             g_idx, BLOCK)
        keys, ids, ok = _sorted_gathered(g_val, g_idx, listed, CAP)
        tau, at, _ = _boundary(keys, ok, tl.where(everything, 0.0, f_hi), limit, lo1 + 1,
                               peak, USE_MASS, CAP)
        at_tau = at + tl.where(everything, 0, count_hi)
        if everything:
            listed_lo = lo1
    return tau, at_tau, listed_lo, listed


@triton.jit
def _listed_threshold(g_val, g_idx, n, flags, top_k, top_p, finite, total, peak,
                      SIZE: tl.constexpr):
    """tau from a list holding every value at or above it (n entries): top-k's boundary,
    then top-p's over what top-k kept (the row's whole mass when top-k is off)."""
    keys, ids, ok = _sorted_gathered(g_val, g_idx, n, SIZE)
    floor = tl.min(tl.where(ok, keys, 2**31 - 1), 0).to(tl.int64)
    tau = floor
    cut = ((flags & 32) != 0) & (top_k < finite)
    if cut:
        tau, _, _ = _boundary(keys, ok, 0.0, top_k.to(tl.float32), floor, peak, False, SIZE)
    if (flags & 64) != 0:
        mass = total
        if cut:  # the list holds all top-k kept (its floor may be top-k's boundary)
            _, _, mass = _boundary(keys, ok, 0.0, 3.0e38, tau, peak, True, SIZE)
        tau, _, _ = _boundary(keys, ok, 0.0, top_p * mass, tau, peak, True, SIZE)
    return tau


@triton.jit
def _select_kernel(x_ptr, stride_x, V, row_slot_ptr, row_pos_ptr, ints_ptr, floats_ptr,
                   part_ptr, part_idx_ptr, num_splits, greedy_ptr, g_val_ptr, g_idx_ptr,
                   lo_ptr, count_ptr, state_ptr, state_f_ptr, token_ptr, tau_ptr, peak_ptr,
                   lse_ptr, lists_ptr, list_len_ptr, list_at_ptr, SPLITS_P2: tl.constexpr,
                   NP: tl.constexpr, BLOCK: tl.constexpr, CAP: tl.constexpr):
    """Program row: combine prepare's partials; a greedy row's token; a random row's
    threshold tau: from the gathered list when its bound held at most CAP values, else by
    the search below; and its draw when the gathered list holds every kept token (else
    tau goes to the draw kernel: token -1, the row on the draw list)."""
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(row_slot_ptr + row).to(tl.int64)
    if slot < 0:
        return
    flags = tl.load(ints_ptr + slot * 8)
    if flags == 0:
        tl.store(token_ptr + row, tl.load(greedy_ptr + row))
        return
    peak, argmax, total, least, finite = _combined(part_ptr, part_idx_ptr, row, num_splits,
                                                   SPLITS_P2)
    if (flags & 16) != 0:
        s = tl.arange(0, SPLITS_P2)
        part = part_ptr + (row * num_splits + s) * 8
        raw_maxes = tl.load(part + 4, mask=s < num_splits, other=float("-inf"))
        raw_peak = tl.max(raw_maxes, 0)
        raw_sums = tl.load(part + 5, mask=s < num_splits, other=0.0)
        lse = raw_peak + tl.log(tl.sum(raw_sums * tl.exp(raw_maxes - raw_peak), 0))
        tl.store(lse_ptr + row, lse)
    tl.store(peak_ptr + row, peak)
    if (flags & 1) == 0:
        tl.store(token_ptr + row, argmax.to(tl.int64))
        return
    if (flags & 224) == 0:
        return  # no truncation: the pick kernel drew it
    if ((flags & 32) == 0) & (tl.load(token_ptr + row) >= 0):
        return  # drawn first, and kept (_bound_kernel)
    top_k = tl.load(ints_ptr + slot * 8 + 1)
    top_p = tl.load(floats_ptr + slot * 8 + 1)
    x_row = x_ptr + row * stride_x
    g_val = g_val_ptr + row * CAP
    g_idx = g_idx_ptr + row * CAP

    top = _key(peak).to(tl.int64)
    tau = _key(least).to(tl.int64)   # every finite value is kept so far
    at_tau = finite                  # values with a key >= tau
    listed_lo = top                  # the gathered list holds every value above this key
    listed = finite * 0              # its length
    bounded = finite * 0
    mode = finite * 0   # the phase the search levels ran (see _bound_kernel)
    if (flags & 96) != 0:
        lo = tl.load(lo_ptr + row)
        listed = tl.load(count_ptr + row)
        mode = tl.load(state_ptr + row * 6 + 4).to(tl.int32)
        bounded = ((mode == 0) & (lo != _INT64_MAX) & (listed <= CAP)).to(tl.int32)
        if bounded != 0:
            listed_lo = lo - 1
            if listed <= 128:
                tau = _listed_threshold(g_val, g_idx, listed, flags, top_k, top_p, finite,
                                        total, peak, 128)
            else:
                tau = _listed_threshold(g_val, g_idx, listed, flags, top_k, top_p, finite,
                                        total, peak, CAP)
    # Where the search levels ran, their state; else the whole row.
    lo0, hi0, count_lo0, count_hi0, f_hi0 = tau - 1, top, finite, finite * 0, peak * 0.0
    if mode != 0:
        state = state_ptr + row * 6
        lo0, hi0 = tl.load(state + 0), tl.load(state + 1)
        count_lo0 = tl.load(state + 2).to(tl.int32)
        count_hi0 = tl.load(state + 3).to(tl.int32)
        f_hi0 = tl.load(state_f_ptr + row * 2)
    if (bounded == 0) & ((flags & 32) != 0) & (top_k < finite):
        tau, at_tau, listed_lo, listed = _phase(
            x_row, V, lo0, hi0, count_lo0, count_hi0, f_hi0, top_k.to(tl.float32), peak,
            (mode == 1).to(tl.int32), listed, listed_lo, g_val, g_idx, False, NP, BLOCK,
            CAP)
    if (bounded == 0) & ((flags & 64) != 0):
        if listed_lo < tau:
            # Every kept value so far is in the sorted list: top-p reads it off.
            keys, ids, ok = _sorted_gathered(g_val, g_idx, listed, CAP)
            _, _, mass = _boundary(keys, ok, 0.0, 3.0e38, tau, peak, True, CAP)
            tau, at_tau, _ = _boundary(keys, ok, 0.0, top_p * mass, tau, peak, True, CAP)
        else:
            mass = total
            if tau > _key(least).to(tl.int64):  # top-k cut: the mass it kept
                _, kept_mass = _above(x_row, 0, V, tl.full((NP,), 0, tl.int64) + tau - 1,
                                      peak, True, NP, BLOCK)
                mass = tl.max(kept_mass, 0)
            limit = top_p * mass
            if mode == 2:
                limit = tl.load(state_f_ptr + row * 2 + 1)
            else:
                lo0, hi0, count_lo0, count_hi0, f_hi0 = tau - 1, top, at_tau, at_tau * 0, \
                    peak * 0.0
            tau, at_tau, listed_lo, listed = _phase(
                x_row, V, lo0, hi0, count_lo0, count_hi0, f_hi0, limit, peak,
                (mode == 2).to(tl.int32), listed, listed_lo, g_val, g_idx, True, NP, BLOCK,
                CAP)
    tl.store(tau_ptr + row, tau)
    if listed_lo < tau:
        # The draw needs no order (ties go to the least id): the list as gathered, unsorted.
        i = tl.arange(0, CAP)
        ok = i < listed
        values = tl.load(g_val + i, mask=ok, other=float("-inf"))
        ids = tl.load(g_idx + i, mask=ok, other=0)
        keep = ok & (_key(values).to(tl.int64) >= tau)
        if (flags & 128) != 0:
            keep = keep & (tl.exp(values - peak) >= tl.load(floats_ptr + slot * 8 + 2))
        seed = tl.load(ints_ptr + slot * 8 + 2)
        position = tl.load(row_pos_ptr + row)
        score = tl.where(keep, values + _gumbel(seed, ids, position), float("-inf"))
        best = tl.max(score, 0)
        token = tl.min(tl.where(keep & (score == best), ids, V), 0)
        tl.store(token_ptr + row, token.to(tl.int64))
    else:  # the draw kernel's
        tl.store(token_ptr + row, -1)
        _append(lists_ptr, list_len_ptr, list_at_ptr, _DRAW, row)


# ---- draw over the whole row, finish ----------------------------------------------------

@triton.jit
def _draw_kernel(x_ptr, stride_x, V, row_slot_ptr, row_pos_ptr, ints_ptr, floats_ptr,
                 tau_ptr, peak_ptr, part_ptr, part_idx_ptr, block_max_ptr, num_blocks,
                 lists_ptr, list_len_ptr, BLOCK: tl.constexpr):
    """A share (_share) of a row on the draw list (select left it undrawn): its part's
    best kept x + gumbel noise and its first index, at part[at] (prepare's partials are
    read by then). A top-k or top-p row skips the blocks whose maximum is under tau."""
    row, at, start, end = _share(lists_ptr, list_len_ptr, _DRAW, V, BLOCK)
    if row < 0:
        return
    slot = tl.load(row_slot_ptr + row).to(tl.int64)
    flags = tl.load(ints_ptr + slot * 8)
    seed = tl.load(ints_ptr + slot * 8 + 2)
    min_p = tl.load(floats_ptr + slot * 8 + 2)
    position = tl.load(row_pos_ptr + row)
    tau = tl.load(tau_ptr + row)
    peak = tl.load(peak_ptr + row)
    lanes = tl.arange(0, BLOCK)
    best = tl.full((BLOCK,), float("-inf"), dtype=tl.float32)
    best_at = lanes + V
    bounded = (flags & 96) != 0  # its blocks' maxima exist (prepare's, or check's)
    for k in range(start, end, BLOCK):
        bm = tl.load(block_max_ptr + row * num_blocks + k // BLOCK, mask=bounded,
                     other=float("inf"))
        if _key(bm).to(tl.int64) >= tau:
            offs = k + lanes
            ok = offs < V
            x = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=float("-inf"))
            keep = ok & (_key(x).to(tl.int64) >= tau)
            if (flags & 128) != 0:
                keep = keep & (tl.exp(x - peak) >= min_p)
            noise = _noise(_uniform_block(seed, k, position, BLOCK))
            score = tl.where(keep, x + noise, float("-inf"))
            take = (score > best) & keep
            best = tl.where(take, score, best)
            best_at = tl.where(take, offs, best_at)
    v, i = tl.reduce((best, best_at), 0, _first_max)
    tl.store(part_ptr + at * 8, v)
    tl.store(part_idx_ptr + at, i)


@triton.jit
def _finish_kernel(logits_ptr, stride_l, V, row_slot_ptr, row_flags_ptr, ints_ptr,
                   counts_ptr, token_ptr, part_ptr, part_idx_ptr, programs, lse_ptr,
                   token_lp_ptr, list_len_ptr, list_at_ptr, BLOCKS_P2: tl.constexpr,
                   PART_BLOCK: tl.constexpr):
    """Program row: the token of a row drawn over the whole vocabulary (the best of its
    parts' draws; `programs`: the draw kernel's); its count in the slot; its logprob
    under the raw logits."""
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(row_slot_ptr + row).to(tl.int64)
    if slot < 0:
        return
    flags = tl.load(ints_ptr + slot * 8)
    if flags == 0:
        return
    token = tl.load(token_ptr + row)
    if token < 0:
        parts, _ = _parts(tl.load(list_len_ptr + _DRAW), programs, V, PART_BLOCK)
        first = tl.load(list_at_ptr + _DRAW * tl.num_programs(0) + row) * parts
        s = tl.arange(0, BLOCKS_P2)
        in_row = s < parts
        scores = tl.load(part_ptr + (first + s) * 8, mask=in_row, other=float("-inf"))
        ids = tl.load(part_idx_ptr + first + s, mask=in_row, other=V)
        _, token = tl.reduce((scores, ids), 0, _first_max)
        token = tl.minimum(token, V - 1).to(tl.int64)
        tl.store(token_ptr + row, token)
    if ((flags & 4) != 0) & ((tl.load(row_flags_ptr + row) & 1) != 0):
        at = counts_ptr + slot * V + token
        tl.store(at, tl.load(at) + 4)
    if (flags & 16) != 0:
        raw = tl.load(logits_ptr + row * stride_l + token).to(tl.float32)
        tl.store(token_lp_ptr + row, raw - tl.load(lse_ptr + row))


# ---- logprobs ------------------------------------------------------------------------

@triton.jit
def _logprob_part_kernel(logits_ptr, stride_l, V, row_slot_ptr, ints_ptr, token_ptr,
                         top_val_ptr, top_idx_ptr, rank_ptr,
                         N: tl.constexpr, BLOCK: tl.constexpr):
    """Program (row, block) of a logprob row: how many raw logits of the block exceed
    the token's, and the block's N largest (first index on ties), largest first."""
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    num_parts = tl.num_programs(1)
    slot = tl.load(row_slot_ptr + row).to(tl.int64)
    if slot < 0:
        return
    flags = tl.load(ints_ptr + slot * 8)
    if (flags & 16) == 0:
        return
    want = tl.load(ints_ptr + slot * 8 + 5)
    offs = part * BLOCK + tl.arange(0, BLOCK)
    ok = offs < V
    raw = tl.load(logits_ptr + row * stride_l + offs, mask=ok,
                  other=float("-inf")).to(tl.float32)
    token = tl.load(token_ptr + row)
    mine = tl.load(logits_ptr + row * stride_l + token).to(tl.float32)
    tl.store(rank_ptr + row * num_parts + part, tl.sum((raw > mine).to(tl.int32), 0))
    out = (row * num_parts + part) * N
    for n in range(0, want):
        v, i = tl.reduce((raw, offs), 0, _first_max)
        tl.store(top_val_ptr + out + n, v)
        tl.store(top_idx_ptr + out + n, i)
        raw = tl.where(offs == i, float("-inf"), raw)


@triton.jit
def _logprob_finish_kernel(row_slot_ptr, ints_ptr, lse_ptr, top_val_ptr, top_idx_ptr,
                           rank_ptr, num_parts, out_val_ptr, out_idx_ptr, out_rank_ptr,
                           N: tl.constexpr, CANDIDATES_P2: tl.constexpr,
                           PARTS_P2: tl.constexpr):
    """Program row: the row's N largest raw logprobs from the blocks' candidates, and the
    token's rank (1 + how many logits exceed its own)."""
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(row_slot_ptr + row).to(tl.int64)
    if slot < 0:
        return
    flags = tl.load(ints_ptr + slot * 8)
    if (flags & 16) == 0:
        return
    want = tl.load(ints_ptr + slot * 8 + 5)
    p = tl.arange(0, PARTS_P2)
    ranks = tl.load(rank_ptr + row * num_parts + p, mask=p < num_parts, other=0)
    tl.store(out_rank_ptr + row, tl.sum(ranks, 0) + 1)
    c = tl.arange(0, CANDIDATES_P2)
    ok = ((c // N) < num_parts) & ((c % N) < want)
    vals = tl.load(top_val_ptr + row * num_parts * N + c, mask=ok, other=float("-inf"))
    ids = tl.load(top_idx_ptr + row * num_parts * N + c, mask=ok, other=2**30)
    lse = tl.load(lse_ptr + row)
    for n in range(0, want):
        v, i = tl.reduce((vals, ids), 0, _first_max)
        tl.store(out_val_ptr + row * N + n, v - lse)
        tl.store(out_idx_ptr + row * N + n, i)
        vals = tl.where(ids == i, float("-inf"), vals)


# ---- launcher ---------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)  # asked on every launch, twice
def sampling_splits(rows: int, vocab: int, device: torch.device) -> int:
    """Programs per row in prepare and draw: enough for ~PROGRAMS_PER_SM programs per SM
    in all, each at least a block of the vocabulary (on a CPU: one per row, the
    interpreter's cost is per program)."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    most = triton.cdiv(vocab, _BLOCK)
    # By the rows' power of two; the kernels' constants do not depend on it (sample_rows),
    # so the row buckets share one compiled variant of each kernel.
    return max(1, min(most, triton.cdiv(PROGRAMS_PER_SM * sms,
                                        triton.next_power_of_2(max(rows, 1)))))


def sample_rows(logits: torch.Tensor, greedy: torch.Tensor, rows, state, scratch, out,
                want_logprobs: bool, block: int = _BLOCK, splits: int | None = None,
                levels: int = _LEVELS, truncating: bool = True, searching: bool = True) -> None:
    """See the module docstring. `rows`: slot [R] int32 (-1: padding), position [R] int64,
    flags [R] int32 (ROW_*), extra [R, KX] int32 (earlier drafts counted at this row, -1
    none), mask [M, ceil(V / 32)] int32 (grammar bitmasks, see ROW_MASK_SHIFT). `state`:
    ints [S, 8] int64, floats [S, 8] float32, counts [S, V] int32, bias [S, V] float32.
    `scratch`: x [>= R, V] float32, part [R * splits * 8] float32, part_idx [R * splits]
    int32, g_val [R, CAP] float32, g_idx [R, CAP] int32, tau, peak, lse [R], lists and
    list_at [4 * R] int32, list_len [4] int32, raw_scale [R] float32, block_max and
    block_lse [R * ceil(V / block)] float32, first [R, FIRST_DRAWS] int64. `out`: token [R]
    int64, token_lp [R] float32, top_val [R, 20] float32, top_idx [R, 20] int32, rank [R]
    int32, lp_val / lp_idx / lp_rank (the logprob blocks' partials). greedy [R] int64: the step's
    argmax, the token of rows whose slot has no flags. block: the values a program reads
    at a time, and the blocks whose maxima bound a truncated row and from which the first
    draws pick (the reference's `block` must be the same); splits: programs a row
    (default sampling_splits); tests take small blocks and several splits on tiny
    vocabularies, and fewer search levels to leave the select kernel's own search some
    rows. truncating False: no row has top-k, top-p or min-p, and the kernels that only
    such rows use (check, bound, fill, the search levels, gather, draw) are not launched:
    about 25 us a step at 256 rows on an H100, where they return at once. searching
    False: no row has top-k or top-p (min-p at most, which needs no threshold search):
    check, the search levels and gather are not launched."""
    mod, _ = kernels_for(__name__, logits.device)
    num_rows, vocab = logits.shape
    if num_rows == 0:
        return
    splits = splits or sampling_splits(num_rows, vocab, logits.device)
    split_len = triton.cdiv(triton.cdiv(vocab, splits), block) * block
    splits = triton.cdiv(vocab, split_len)
    # The partials' width is the most splits this vocabulary takes (one row's), not this
    # launch's: one compiled variant serves every row bucket (the buckets took 7, and the
    # sampler's capture spent 41.5-68 s compiling on an empty Triton cache).
    splits_p2 = triton.next_power_of_2(max(splits, sampling_splits(1, vocab, logits.device)))
    kx = rows.extra.shape[1]
    x = scratch.x
    cap = scratch.g_val.shape[1]
    num_blocks = triton.cdiv(vocab, block)
    blocks_p2 = triton.next_power_of_2(num_blocks)
    programs = num_rows * splits  # of each launch over the work lists
    lists = (scratch.lists, scratch.list_len, scratch.list_at)
    mod._prepare_kernel[(num_rows, splits)](
        logits, logits.stride(0), x, x.stride(0), state.counts, state.bias, vocab,
        rows.slot, rows.position, rows.extra, rows.flags, rows.mask, rows.mask.shape[1],
        state.ints, state.floats, scratch.part, scratch.part_idx, scratch.block_max,
        scratch.block_lse, num_blocks, split_len, scratch.list_len, scratch.raw_scale, KX=kx,
        BLOCK=block, STAGES=_LOOP_STAGES, num_warps=4)
    mod._pick_kernel[(num_rows,)](
        logits, logits.stride(0), state.counts, state.bias, vocab, rows.slot, rows.position,
        rows.extra, rows.flags, rows.mask, rows.mask.shape[1], state.ints, state.floats,
        scratch.block_lse, num_blocks, out.token, scratch.first, KX=kx, BLOCK=block,
        BLOCKS_P2=blocks_p2, DRAWS=FIRST_DRAWS, num_warps=4)
    if truncating and searching:
        mod._check_kernel[(num_rows, splits)](
            x, x.stride(0), logits, logits.stride(0), vocab, rows.slot, state.ints,
            state.floats, scratch.part, scratch.raw_scale, scratch.block_max,
            scratch.block_lse, num_blocks, scratch.level_mass, split_len, scratch.first,
            SPLITS_P2=splits_p2, BLOCKS_P2=blocks_p2, NP=_LEVEL_PIVOTS, BLOCK=block,
            STAGES=_LOOP_STAGES, DRAWS=FIRST_DRAWS, num_warps=4)
    if truncating:
        mod._bound_kernel[(num_rows,)](
            x, x.stride(0), logits, logits.stride(0), vocab, rows.slot, state.ints,
            state.floats, scratch.part, scratch.part_idx, scratch.raw_scale, splits,
            scratch.block_max, num_blocks, scratch.lo, scratch.hi, scratch.count, scratch.peak,
            scratch.search, scratch.search_f, scratch.pivots, scratch.level_mass, out.token,
            scratch.tau, *lists, scratch.first, SPLITS_P2=splits_p2, BLOCKS_P2=blocks_p2,
            NP=_LEVEL_PIVOTS, CAP=cap, DRAWS=FIRST_DRAWS, num_warps=4)
        mod._fill_kernel[(num_rows, splits)](
            logits, logits.stride(0), x, x.stride(0), vocab, scratch.raw_scale, scratch.lists,
            scratch.list_len, BLOCK=block, num_warps=4)
    if truncating and searching:
        for _ in range(levels):
            mod._level_kernel[(num_rows, splits)](
                x, x.stride(0), vocab, scratch.search, scratch.pivots, scratch.peak,
                scratch.level_count, scratch.level_mass, scratch.lists, scratch.list_len,
                NP=_LEVEL_PIVOTS, PART_BLOCK=block, BLOCK=min(block, 256), STAGES=_LOOP_STAGES,
                num_warps=4)
            mod._narrow_kernel[(num_rows,)](
                rows.slot, scratch.search, scratch.search_f, scratch.pivots,
                scratch.level_count, scratch.level_mass, programs, vocab, scratch.lo,
                scratch.hi, *lists, NP=_LEVEL_PIVOTS, CAP=cap, PART_BLOCK=block, num_warps=1)
        mod._gather_kernel[(num_rows, splits * _GATHER_SPREAD)](
            x, x.stride(0), vocab, scratch.lo, scratch.hi, scratch.count, scratch.g_val,
            scratch.g_idx, scratch.block_max, num_blocks, scratch.lists, scratch.list_len,
            CAP=cap, BLOCKS_P2=blocks_p2, BLOCK=block, num_warps=4)
    mod._select_kernel[(num_rows,)](
        x, x.stride(0), vocab, rows.slot, rows.position, state.ints, state.floats,
        scratch.part, scratch.part_idx, splits, greedy, scratch.g_val, scratch.g_idx,
        scratch.lo, scratch.count, scratch.search, scratch.search_f, out.token, scratch.tau,
        scratch.peak, scratch.lse, *lists, SPLITS_P2=splits_p2, NP=_PIVOTS,
        BLOCK=min(block, 512), CAP=cap, num_warps=8)
    if truncating:
        mod._draw_kernel[(num_rows, splits)](
            x, x.stride(0), vocab, rows.slot, rows.position, state.ints, state.floats,
            scratch.tau, scratch.peak, scratch.part, scratch.part_idx, scratch.block_max,
            num_blocks, scratch.lists, scratch.list_len, BLOCK=block, num_warps=4)
    mod._finish_kernel[(num_rows,)](
        logits, logits.stride(0), vocab, rows.slot, rows.flags, state.ints, state.counts,
        out.token, scratch.part, scratch.part_idx, programs, scratch.lse, out.token_lp,
        scratch.list_len, scratch.list_at, BLOCKS_P2=blocks_p2, PART_BLOCK=block,
        num_warps=1)
    if not want_logprobs:
        return
    parts = triton.cdiv(vocab, _LP_BLOCK)
    mod._logprob_part_kernel[(num_rows, parts)](
        logits, logits.stride(0), vocab, rows.slot, state.ints, out.token,
        out.lp_val, out.lp_idx, out.lp_rank, N=MAX_LOGPROBS, BLOCK=_LP_BLOCK, num_warps=8)
    mod._logprob_finish_kernel[(num_rows,)](
        rows.slot, state.ints, scratch.lse, out.lp_val, out.lp_idx, out.lp_rank, parts,
        out.top_val, out.top_idx, out.rank, N=MAX_LOGPROBS,
        CANDIDATES_P2=triton.next_power_of_2(parts * MAX_LOGPROBS),
        PARTS_P2=triton.next_power_of_2(parts), num_warps=4)
