"""Triton kernels of minivllm (paged KV cache write + paged attention).

This module only defines the ``@triton.jit`` kernels; the launch wrappers live
in ``csrc_triton/__init__.py``.  The module may be loaded twice: once normally
(compiled kernels for CUDA tensors) and once under ``TRITON_INTERPRET=1``
(interpreted kernels for CPU tensors), see ``__init__._kernels_for``.

Conventions shared by all kernels
---------------------------------
* KV cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` per K and V.
  Token position ``p`` of a sequence lives in physical block
  ``block_table[p // BLOCK_SIZE]`` at offset ``p % BLOCK_SIZE``.
* Softmax runs in the log2 domain: ``qk_scale = scale * log2(e)`` and
  ``exp2`` is used everywhere; log-sum-exps written by the decode kernel are
  log2-domain as well.
* ``DOT_FP32`` selects fp32 operands for ``tl.dot`` with
  ``input_precision="ieee"`` (exact fp32 path; also used for bf16 under the
  interpreter, whose bf16 arithmetic is unreliable).  Otherwise operands are
  fed to ``tl.dot`` in the cache dtype (fp16/bf16) with fp32 accumulation.
"""

import triton
import triton.language as tl

from csrc_triton._interpret import jit_helpers

_fp8_cast = jit_helpers("_fp8_cast")
_pdl = jit_helpers("_pdl")


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kcb, stride_kcs, stride_kch, stride_kcd,
    stride_vcb, stride_vcs, stride_vch, stride_vcd,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False,
):
    _pdl.wait_for_previous(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    # slot broadcast over the head axis (a scalar & tensor mask trips the
    # interpreter); negative slot = padding token, skipped.
    slot = tl.load(slot_ptr + t).to(tl.int64) + tl.zeros([BLOCK_H], dtype=tl.int64)
    valid = slot >= 0
    slot = tl.where(valid, slot, 0)
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    mask = valid[:, None] & (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)

    k = tl.load(key_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :] * stride_kd,
                mask=mask, other=0.0)
    v = tl.load(value_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd,
                mask=mask, other=0.0)
    row_k = blk * stride_kcb + off * stride_kcs + offs_h * stride_kch
    row_v = blk * stride_vcb + off * stride_vcs + offs_h * stride_vch
    kc = k_cache_ptr + row_k[:, None] + offs_d[None, :] * stride_kcd
    vc = v_cache_ptr + row_v[:, None] + offs_d[None, :] * stride_vcd
    tl.store(kc, _fp8_cast.to_cache(k, k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(vc, _fp8_cast.to_cache(v, v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _attn_tiles(
    acc, m_i, l_i, q, q_pos,
    k_cache_ptr, v_cache_ptr, bt_row_ptr, stride_btn,
    kvh, lo, hi,
    qk_scale,
    stride_kcb, stride_kcs, stride_kch, stride_kcd,
    stride_vcb, stride_vcs, stride_vch, stride_vcd,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, DOT_FP32: tl.constexpr,
    k_desc=None, v_desc=None, USE_TMA: tl.constexpr = False,
    WINDOW: tl.constexpr = 0, SOFTCAP: tl.constexpr = 0.0,
):
    """Online-softmax accumulation over kv positions [lo, hi), tile by tile.

    MASKED: positions >= hi are masked (and not loaded); CAUSAL additionally
    masks kv positions > q_pos[row], WINDOW (a sliding window, 0: none) those
    <= q_pos[row] - WINDOW: a masked tile may then reach into blocks freed out of
    the window (table entries -1), read as block 0 and masked. Without MASKED
    every position in [lo, hi) must be valid for every row (hi - lo a multiple
    of BLOCK_N). SOFTCAP (0: none): scores -> SOFTCAP * tanh(scores / SOFTCAP)
    (Gemma 2), before the masks.

    USE_TMA: each tile lies inside one block (BLOCK_SIZE % BLOCK_N == 0, lo a multiple
    of BLOCK_N) and is loaded whole through the tensor descriptors k_desc / v_desc over
    the cache seen as [num_blocks * BLOCK_SIZE, num_kv_heads * HEAD_DIM]: one block-table
    entry and one bulk copy per tile instead of a gather of per-token addresses. A
    masked tile's rows past hi are still in the sequence's own (zero-initialized) block;
    their keys are masked and their values zeroed.
    """
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    for start in range(lo, hi, BLOCK_N):
        pos = start + offs_n
        if USE_TMA:
            page = tl.load(bt_row_ptr + (start // BLOCK_SIZE) * stride_btn)
            if WINDOW > 0:
                page = tl.maximum(page, 0)
            row = page * BLOCK_SIZE + start % BLOCK_SIZE
            k = k_desc.load([row, kvh * HEAD_DIM])
            v = v_desc.load([row, kvh * HEAD_DIM])
            if MASKED:
                n_valid = pos < hi
                v = tl.where(n_valid[:, None], v, 0.0)
        elif MASKED:
            n_valid = pos < hi
            # Positions past hi take the last block's table entry (an index inside the
            # table, no mask): the blocks' tokens stay contiguous runs, so an e4m3 V tile
            # (tokens contiguous) loads in vectors, not bytes; its columns past hi are zeroed.
            last = (hi - 1) // BLOCK_SIZE
            blk = tl.load(bt_row_ptr + tl.minimum(pos // BLOCK_SIZE, last) * stride_btn).to(tl.int64)
            if WINDOW > 0:
                blk = tl.maximum(blk, 0)
            ld_mask = n_valid[:, None] & d_mask[None, :]
            vt_mask = None if BLOCK_D == HEAD_DIM else d_mask[:, None]
            other = 0.0
        elif BLOCK_D == HEAD_DIM:
            blk = tl.load(bt_row_ptr + (pos // BLOCK_SIZE) * stride_btn).to(tl.int64)
            ld_mask = None  # whole tiles load unmasked (masks cost the e4m3 tiles most)
            vt_mask = None
            other = None
        else:
            blk = tl.load(bt_row_ptr + (pos // BLOCK_SIZE) * stride_btn).to(tl.int64)
            ld_mask = d_mask[None, :]
            vt_mask = d_mask[:, None]
            other = 0.0
        if not USE_TMA:
            # 64-bit block offsets, 32-bit offsets inside a block (fewer address instructions)
            off = pos % BLOCK_SIZE
            k_row = blk * stride_kcb + (off * stride_kcs + kvh * stride_kch)
            v_row = blk * stride_vcb + (off * stride_vcs + kvh * stride_vch)
            k = tl.load(k_cache_ptr + k_row[:, None] + offs_d[None, :] * stride_kcd,
                        mask=ld_mask, other=other)
            if v_cache_ptr.dtype.element_ty.is_fp8():
                # Stored with its tokens contiguous (worker/kv_cache.value_cache): loaded as
                # [D, N], converted, then transposed, so that the tokens stay the contiguous
                # dimension of the dot's operand (docs/decisions.md, "FP8 KV cache").
                vt = tl.load(v_cache_ptr + v_row[None, :] + offs_d[:, None] * stride_vcd,
                             mask=vt_mask, other=None if vt_mask is None else 0.0)
                v = tl.trans(vt.to(q.dtype))
                if MASKED:
                    v = tl.where(n_valid[:, None], v, 0.0)
            else:
                v = tl.load(v_cache_ptr + v_row[:, None] + offs_d[None, :] * stride_vcd,
                            mask=ld_mask, other=other)
        if k_cache_ptr.dtype.element_ty.is_fp8():  # half the bytes; the products in q's dtype
            # (fp16 for a bf16 model: see the kernels' q)
            k = k.to(q.dtype)
        if DOT_FP32:
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * qk_scale
        if SOFTCAP > 0.0:  # in log2 units, like the scores: cap * log2(e)
            s = (SOFTCAP * 1.4426950408889634) * _tanh(s / (SOFTCAP * 1.4426950408889634))
        if MASKED:
            keep = n_valid[None, :]
            if CAUSAL:
                keep = keep & (pos[None, :] <= q_pos[:, None])
            if WINDOW > 0:
                keep = keep & (pos[None, :] > q_pos[:, None] - WINDOW)
            s = tl.where(keep, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = m_new
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if DOT_FP32:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _tanh(x):
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x >= 0, t, -t)


@triton.jit
def _tile_owner(query_start_loc_ptr, tile, num_seqs, GQA: tl.constexpr, BLOCK_M: tl.constexpr):
    """The sequence whose tiles include `tile`: the last i with first_tile(i) <= tile,
    first_tile(i) = qsl[i] * GQA // BLOCK_M + i (binary search; strictly increasing in i).
    Sequence i gets first_tile(i+1) - first_tile(i) >= cdiv(qlen_i * GQA, BLOCK_M) tiles,
    as floor(b/M) - floor(a/M) + 1 >= ceil((b - a)/M); the surplus tiles, and those past
    the last sequence's, find no rows and return."""
    lo = tile * 0
    hi = lo + num_seqs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        first = tl.load(query_start_loc_ptr + mid) * GQA // BLOCK_M + mid
        below = first <= tile
        lo = tl.where(below, mid, lo)
        hi = tl.where(below, hi, mid)
    return lo


# num_seqs and the block tables' row stride (the batch's widest table in an eager step)
# vary from step to step under serving: no specialization on their values (== 1,
# divisible by 16), which would compile new variants mid-serving; both only offset scalars.
@triton.jit(do_not_specialize=["num_seqs", "stride_bts"])
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    qk_scale,
    stride_qt, stride_qh, stride_qd,
    stride_ot, stride_oh, stride_od,
    stride_kcb, stride_kcs, stride_kch, stride_kcd,
    stride_vcb, stride_vcs, stride_vch, stride_vcd,
    stride_bts, stride_btn,
    num_seqs,
    GQA: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_FP32: tl.constexpr, HEAVY_FIRST: tl.constexpr,
    k_desc=None, v_desc=None, USE_TMA: tl.constexpr = False, PDL: tl.constexpr = False,
    WINDOW: tl.constexpr = 0, SOFTCAP: tl.constexpr = 0.0,
):
    """Varlen causal attention over the paged cache (within a sliding WINDOW when > 0;
    SOFTCAP: see _attn_tiles).

    grid = (num_tokens * GQA // BLOCK_M + num_seqs, num_kv_heads): one program
    per row tile of the whole batch, not per (tile of the longest query,
    sequence) pair, which in a mixed step of one prefill and many decodes (or
    a CUDA graph padded to max_seqs sequences) launched mostly empty programs.
    Sequence i owns the tiles from first_tile(i) = qsl[i] * GQA // BLOCK_M + i
    on: at least as many as its query rows need (see _tile_owner).
    The M dimension packs (query token, head of the GQA group) pairs:
    row r of the flattened per-sequence index covers token r // GQA and
    query head kvh * GQA + r % GQA, so every K/V tile is loaded once for the
    whole GQA group.

    HEAVY_FIRST: programs run in reverse tile order. A sequence's last row tiles attend
    to the most keys; started first, they leave short tiles for the tail of the launch.
    """
    _pdl.wait_for_previous(PDL)  # before the early return below (see _pdl)
    tile = tl.program_id(0)
    if HEAVY_FIRST:
        tile = tl.num_programs(0) - 1 - tile
    kvh = tl.program_id(1)

    seq = _tile_owner(query_start_loc_ptr, tile, num_seqs, GQA, BLOCK_M)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_end = tl.load(query_start_loc_ptr + seq + 1)
    qlen = q_end - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx = seq_len - qlen

    pid_m = tile - (q_start * GQA // BLOCK_M + seq)
    row0 = pid_m * BLOCK_M
    if (row0 < 0) | (row0 >= qlen * GQA):  # below: tiles before qsl[0] > 0
        return

    rows = row0 + tl.arange(0, BLOCK_M)
    tok = rows // GQA
    head = kvh * GQA + rows % GQA
    row_valid = tok < qlen
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    tok64 = (q_start + tok).to(tl.int64)

    q_mask = row_valid[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + tok64[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=q_mask, other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    elif k_cache_ptr.dtype.element_ty.is_fp8():
        q = q.to(tl.float16)  # e4m3 -> fp16 is one instruction per pair; -> bf16 is not
    else:
        q = q.to(k_cache_ptr.dtype.element_ty)
    q_pos = ctx + tok

    tok_lo = row0 // GQA
    tok_hi = tl.minimum((row0 + BLOCK_M - 1) // GQA, qlen - 1)
    kv_end = ctx + tok_hi + 1                       # <= seq_len
    full_end = ((ctx + tok_lo + 1) // BLOCK_N) * BLOCK_N  # visible to every row of the tile

    bt_row_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bts
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)

    # Keys [0, full_end) are visible to every row; with a window, only those from
    # mid_lo on are (keys [lo_all, mid_lo) are in some rows' windows: masked tiles).
    lo_all = full_end * 0
    mid_lo = lo_all
    if WINDOW > 0:
        lo_all = tl.maximum(ctx + tok_lo - WINDOW + 1, 0) // BLOCK_N * BLOCK_N
        mid_lo = tl.cdiv(tl.maximum(ctx + tok_hi - WINDOW + 1, 0), BLOCK_N) * BLOCK_N
        mid_lo = tl.minimum(tl.maximum(mid_lo, lo_all), full_end)
        acc, m_i, l_i = _attn_tiles(
            acc, m_i, l_i, q, q_pos, k_cache_ptr, v_cache_ptr, bt_row_ptr, stride_btn, kvh, lo_all, mid_lo, qk_scale,
            stride_kcb, stride_kcs, stride_kch, stride_kcd, stride_vcb, stride_vcs, stride_vch, stride_vcd,
            HEAD_DIM, BLOCK_SIZE, BLOCK_N, BLOCK_D, True, True, DOT_FP32, k_desc, v_desc, USE_TMA,
            WINDOW, SOFTCAP)
    acc, m_i, l_i = _attn_tiles(
        acc, m_i, l_i, q, q_pos, k_cache_ptr, v_cache_ptr, bt_row_ptr, stride_btn, kvh, mid_lo, full_end, qk_scale,
        stride_kcb, stride_kcs, stride_kch, stride_kcd, stride_vcb, stride_vcs, stride_vch, stride_vcd,
        HEAD_DIM, BLOCK_SIZE, BLOCK_N, BLOCK_D, False, False, DOT_FP32, k_desc, v_desc, USE_TMA,
        WINDOW, SOFTCAP)
    acc, m_i, l_i = _attn_tiles(
        acc, m_i, l_i, q, q_pos, k_cache_ptr, v_cache_ptr, bt_row_ptr, stride_btn, kvh,
        tl.maximum(full_end, lo_all), kv_end, qk_scale,
        stride_kcb, stride_kcs, stride_kch, stride_kcd, stride_vcb, stride_vcs, stride_vch, stride_vcd,
        HEAD_DIM, BLOCK_SIZE, BLOCK_N, BLOCK_D, True, True, DOT_FP32, k_desc, v_desc, USE_TMA,
        WINDOW, SOFTCAP)

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_safe[:, None]
    tl.store(out_ptr + tok64[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :] * stride_od,
             o.to(out_ptr.dtype.element_ty), mask=q_mask)


@triton.jit(do_not_specialize=["stride_bts", "min_tiles"])  # see _prefill_kernel
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_o_ptr, part_lse_ptr, counters_ptr,
    block_tables_ptr, seq_lens_ptr,
    qk_scale,
    stride_qt, stride_qh, stride_qd,
    stride_ot, stride_oh, stride_od,
    stride_kcb, stride_kcs, stride_kch, stride_kcd,
    stride_vcb, stride_vcs, stride_vch, stride_vcd,
    stride_bts, stride_btn, min_tiles,
    NUM_Q_HEADS: tl.constexpr, GQA: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr, DOT_FP32: tl.constexpr, FUSED_REDUCE: tl.constexpr,
    PDL: tl.constexpr = False, WINDOW: tl.constexpr = 0, SOFTCAP: tl.constexpr = 0.0,
):
    """Flash-decoding, one query token per sequence (within a sliding WINDOW when > 0:
    the splits share out the keys from the window's first tile on, _decode_span;
    SOFTCAP: see _attn_tiles).

    grid = (num_seqs, num_kv_heads, NUM_SPLITS).  Each program handles one
    contiguous chunk of the sequence's context for the whole GQA group (query
    heads in the M dimension of tl.dot, padded to BLOCK_G >= 16).  The chunk
    length is derived per sequence from its seq_len (balanced splits, whole tiles, at
    least min_tiles of them), but the grid depends only on
    NUM_SPLITS.  With NUM_SPLITS == 1 the normalised
    output is written directly; otherwise the partial output (normalised) and
    its log2-sum-exp go to part_o [S, Hq, NUM_SPLITS, D] / part_lse
    [S, Hq, NUM_SPLITS] for _decode_reduce_kernel.

    FUSED_REDUCE: no second kernel. Each program with tokens counts itself done on an
    int32 counter per (sequence, kv head) (counters_ptr, zero before the launch); the one
    that completes the count reads every used split's partials and writes the output,
    then sets the counter back to zero for the next launch. At batch 1 a decode
    step is a chain of latency-bound launches, and this removes one per layer.
    """
    _pdl.wait_for_previous(PDL)  # before the early return below (see _pdl)
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + seq)
    base, span = _decode_span(seq_len, WINDOW, BLOCK_N)
    chunk = _split_chunk(span, min_tiles, NUM_SPLITS, BLOCK_N)
    lo = base + split * chunk
    hi = tl.minimum(lo + chunk, seq_len)
    # Splits past the sequence's end have nothing to add: they leave at once (no partials,
    # no count), and the splits that saw tokens (one for an empty row) are combined.
    n_used = tl.maximum(tl.cdiv(span, tl.maximum(chunk, 1)), 1)
    if split >= n_used:
        return

    offs_g = tl.arange(0, BLOCK_G)
    g_valid = offs_g < GQA
    head = kvh * GQA + offs_g
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    qo_mask = g_valid[:, None] & d_mask[None, :]
    seq64 = seq.to(tl.int64)

    q = tl.load(q_ptr + seq64 * stride_qt + head[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=qo_mask, other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    elif k_cache_ptr.dtype.element_ty.is_fp8():
        q = q.to(tl.float16)  # e4m3 -> fp16 is one instruction per pair; -> bf16 is not
    else:
        q = q.to(k_cache_ptr.dtype.element_ty)
    q_pos = tl.zeros([BLOCK_G], dtype=tl.int32) + (seq_len - 1)  # read by WINDOW's mask

    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    bt_row_ptr = block_tables_ptr + seq64 * stride_bts
    # Whole tiles unmasked, then the tail: with per-token masks on every tile the e4m3
    # cache's kernel (bound by instructions, not bytes) took 859 us a layer at batch 64,
    # context 8192, against 412 (docs/decisions.md).
    first = lo
    if WINDOW > 0:  # the window's first tile, partly before it: masked
        first = tl.where((lo == base) & (seq_len - WINDOW > base),
                         tl.minimum(hi, base + BLOCK_N), lo)
        acc, m_i, l_i = _attn_tiles(
            acc, m_i, l_i, q, q_pos, k_cache_ptr, v_cache_ptr, bt_row_ptr, stride_btn, kvh, lo, first, qk_scale,
            stride_kcb, stride_kcs, stride_kch, stride_kcd, stride_vcb, stride_vcs, stride_vch, stride_vcd,
            HEAD_DIM, BLOCK_SIZE, BLOCK_N, BLOCK_D, True, False, DOT_FP32,
            WINDOW=WINDOW, SOFTCAP=SOFTCAP)
    full_hi = first + (hi - first) // BLOCK_N * BLOCK_N
    acc, m_i, l_i = _attn_tiles(
        acc, m_i, l_i, q, q_pos, k_cache_ptr, v_cache_ptr, bt_row_ptr, stride_btn, kvh, first, full_hi, qk_scale,
        stride_kcb, stride_kcs, stride_kch, stride_kcd, stride_vcb, stride_vcs, stride_vch, stride_vcd,
        HEAD_DIM, BLOCK_SIZE, BLOCK_N, BLOCK_D, False, False, DOT_FP32, SOFTCAP=SOFTCAP)
    acc, m_i, l_i = _attn_tiles(
        acc, m_i, l_i, q, q_pos, k_cache_ptr, v_cache_ptr, bt_row_ptr, stride_btn, kvh, full_hi, hi, qk_scale,
        stride_kcb, stride_kcs, stride_kch, stride_kcd, stride_vcb, stride_vcs, stride_vch, stride_vcd,
        HEAD_DIM, BLOCK_SIZE, BLOCK_N, BLOCK_D, True, False, DOT_FP32, SOFTCAP=SOFTCAP)

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_safe[:, None]
    if NUM_SPLITS == 1:
        tl.store(out_ptr + seq64 * stride_ot + head[:, None] * stride_oh + offs_d[None, :] * stride_od,
                 o.to(out_ptr.dtype.element_ty), mask=qo_mask)
    elif n_used == 1:  # the whole context in this split: nothing to combine
        tl.store(out_ptr + seq64 * stride_ot + head[:, None] * stride_oh + offs_d[None, :] * stride_od,
                 o.to(out_ptr.dtype.element_ty), mask=qo_mask)
    else:
        lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
        prow = (seq64 * NUM_Q_HEADS + head) * NUM_SPLITS + split
        tl.store(part_o_ptr + prow[:, None] * HEAD_DIM + offs_d[None, :], o, mask=qo_mask)
        tl.store(part_lse_ptr + prow, lse, mask=g_valid)
        if FUSED_REDUCE:
            # Every thread's stores are issued before one thread's release-acquire
            # increment, so the program that sees the final count also sees them.
            tl.debug_barrier()
            counter = counters_ptr + seq64 * tl.num_programs(1) + kvh
            done = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if done == n_used - 1:
                _combine_splits(part_o_ptr, part_lse_ptr, out_ptr, seq64, head, offs_d,
                                g_valid, qo_mask, chunk, span, stride_ot, stride_oh,
                                stride_od, NUM_Q_HEADS, HEAD_DIM, BLOCK_G, BLOCK_D,
                                NUM_SPLITS)
                tl.store(counter, 0)


@triton.jit
def _combine_splits(part_o_ptr, part_lse_ptr, out_ptr, seq64, head, offs_d, g_valid, qo_mask,
                    chunk, seq_len, stride_ot, stride_oh, stride_od,
                    NUM_Q_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr,
                    BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr):
    """The fused reduce: weight each used split's output by its share of the total
    sum-exp, for the GQA group's query heads (the arithmetic of _decode_reduce_kernel,
    a split at a time). Loads go to L2 (.cg): other programs wrote the partials."""
    n_used = tl.cdiv(seq_len, tl.maximum(chunk, 1))
    base = (seq64 * NUM_Q_HEADS + head) * NUM_SPLITS
    lse_max = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    for s in range(0, n_used):
        lse_s = tl.load(part_lse_ptr + base + s, mask=g_valid, other=float("-inf"),
                        cache_modifier=".cg")
        lse_max = tl.maximum(lse_max, lse_s)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    denom = tl.zeros([BLOCK_G], dtype=tl.float32)
    for s in range(0, n_used):
        lse_s = tl.load(part_lse_ptr + base + s, mask=g_valid, other=float("-inf"),
                        cache_modifier=".cg")
        w = tl.exp2(lse_s - lse_max)
        o_s = tl.load(part_o_ptr + (base + s)[:, None] * HEAD_DIM + offs_d[None, :],
                      mask=qo_mask, other=0.0, cache_modifier=".cg")
        acc += o_s * w[:, None]
        denom += w
    denom = tl.where(denom > 0.0, denom, 1.0)
    res = acc / denom[:, None]
    tl.store(out_ptr + seq64 * stride_ot + head[:, None] * stride_oh + offs_d[None, :] * stride_od,
             res.to(out_ptr.dtype.element_ty), mask=qo_mask)


@triton.jit
def _decode_span(seq_len, WINDOW: tl.constexpr, BLOCK_N: tl.constexpr):
    """(base, span): a decode query's keys, from the tile of the window's first key (0
    without a window) to seq_len; the splits share out the span."""
    base = seq_len * 0
    if WINDOW > 0:
        base = tl.maximum(seq_len - WINDOW, 0) // BLOCK_N * BLOCK_N
    return base, seq_len - base


@triton.jit
def _split_chunk(seq_len, min_tiles, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """A split's share of a sequence's context: balanced, >= min_tiles whole tiles. The
    product with BLOCK_N last, so the compiler knows every split starts on a tile (an
    e4m3 V tile then loads in vectors: with the maximum taken after it, in tokens, the
    e4m3 decode layer ran 5.6x slower)."""
    return tl.maximum(tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N), min_tiles) * BLOCK_N


@triton.jit(do_not_specialize=["min_tiles"])
def _decode_reduce_kernel(
    part_o_ptr, part_lse_ptr, out_ptr, seq_lens_ptr,
    stride_ot, stride_oh, stride_od, min_tiles,
    NUM_Q_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr = False,
    WINDOW: tl.constexpr = 0,
):
    """Combine the NUM_SPLITS partial results of one (sequence, query head)."""
    _pdl.wait_for_previous(PDL)
    seq = tl.program_id(0)
    h = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    _, span = _decode_span(seq_len, WINDOW, BLOCK_N)
    chunk = _split_chunk(span, min_tiles, NUM_SPLITS, BLOCK_N)
    n_used = tl.cdiv(span, tl.maximum(chunk, 1))  # splits that saw >= 1 token
    if n_used <= 1:
        return  # the split kernel wrote the output itself

    offs_s = tl.arange(0, BLOCK_S)
    s_mask = (offs_s < n_used) & (offs_s < NUM_SPLITS)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    seq64 = seq.to(tl.int64)
    prow = (seq64 * NUM_Q_HEADS + h) * NUM_SPLITS + offs_s

    lse = tl.load(part_lse_ptr + prow, mask=s_mask, other=float("-inf"))
    lse_max = tl.max(lse, 0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    w = tl.exp2(lse - lse_max)
    w = tl.where(s_mask, w, 0.0)
    o = tl.load(part_o_ptr + prow[:, None] * HEAD_DIM + offs_d[None, :],
                mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    denom = tl.sum(w, 0)
    denom = tl.where(denom > 0.0, denom, 1.0)
    res = tl.sum(o * w[:, None], 0) / denom
    tl.store(out_ptr + seq64 * stride_ot + h * stride_oh + offs_d * stride_od,
             res.to(out_ptr.dtype.element_ty), mask=d_mask)
