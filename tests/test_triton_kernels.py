"""Tests of the Triton kernels in csrc_triton against a dense torch reference.

On a machine without CUDA the kernels run under Triton's interpreter
(TRITON_INTERPRET=1, set by conftest.py before csrc_triton is imported; CPU tensors
always go through the interpreter anyway), so the shapes here are tiny.  On
a CUDA machine (without TRITON_INTERPRET=1) the same tests run compiled on the
GPU, plus the ``@pytest.mark.gpu`` tests with realistic shapes.
"""

import os

import pytest
import torch

pytest.importorskip("triton")  # conftest.py has chosen the interpreter on CPU-only machines

import csrc_triton  # noqa: E402
from conftest import assert_e4m3_matches  # noqa: E402

from csrc_triton import paged_attention, paged_attention_decode, store_kv_cache

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
DEVICE = "cuda" if (torch.cuda.is_available() and not INTERPRET) else "cpu"

TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 2e-2}


# ----------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------
def make_cache(num_blocks, block_size, hkv, d, dtype, gen):
    """K and V in the engine's layouts (an e4m3 V cache is a transposed view)."""
    from minivllm.worker.kv_cache import value_cache

    shape = (num_blocks, block_size, hkv, d)
    k = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
    v = value_cache(shape, dtype, torch.device(DEVICE))
    v.copy_(torch.randn(shape, generator=gen).to(dtype))
    return k, v


def test_fp8_value_cache_is_stored_transposed():
    """[blocks, block_size, Hkv, D] to its users, tokens contiguous in memory for e4m3;
    the model dtype's V cache is plain."""
    from minivllm.worker.kv_cache import value_cache

    v = value_cache((3, 16, 2, 8), torch.float8_e4m3fn, torch.device("cpu"))
    assert v.shape == (3, 16, 2, 8) and v.stride() == (256, 1, 128, 16)
    assert value_cache((3, 16, 2, 8), torch.bfloat16, torch.device("cpu")).is_contiguous()


def make_block_tables(seq_lens, block_size, num_blocks, gen, max_blocks=None):
    """Random permuted (non-identity) block assignment; unused entries are
    filled with an out-of-range value so that reading them would be caught
    (either as garbage or as an out-of-bounds access)."""
    need = [-(-int(s) // block_size) for s in seq_lens]
    width = max(max(need, default=1), 1) if max_blocks is None else max_blocks
    assert sum(need) <= num_blocks
    perm = torch.randperm(num_blocks, generator=gen)
    bt = torch.full((len(seq_lens), width), 0, dtype=torch.int32)
    pos = 0
    for i, n in enumerate(need):
        bt[i, :n] = perm[pos:pos + n].to(torch.int32)
        if n < width:
            bt[i, n:] = 10_000_000  # never read
        pos += n
    return bt.to(DEVICE)


def ref_attention(q, k_cache, v_cache, block_tables, seq_lens, qsl, scale):
    """Dense fp32 reference; returns [T, Hq, D] fp32 (rows of no sequence = 0)."""
    return ref_windowed(q, k_cache, v_cache, block_tables, seq_lens, qsl, scale, 0, 0.0)


def rel_err(out, ref):
    return ((out.float() - ref).norm() / ref.norm().clamp_min(1e-12)).item()


def run_case(seq_lens, q_lens, hq, hkv, d, block_size, dtype, seed=0, num_blocks=None,
             fused_qkv=False, check_decode_direct=False, num_splits=None, cache_dtype=None,
             use_tma=None):
    gen = torch.Generator().manual_seed(seed)
    need = sum(-(-s // block_size) for s in seq_lens)
    num_blocks = num_blocks or need + 3
    k_cache, v_cache = make_cache(num_blocks, block_size, hkv, d, cache_dtype or dtype, gen)
    bt = make_block_tables(seq_lens, block_size, num_blocks, gen)
    T = sum(q_lens)
    if fused_qkv:
        qkv = torch.randn(T, (hq + 2 * hkv) * d, generator=gen).to(dtype).to(DEVICE)
        q = qkv[:, : hq * d].view(T, hq, d)
        assert not q.is_contiguous()
    else:
        q = torch.randn(T, hq, d, generator=gen).to(dtype).to(DEVICE)
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0).tolist()), dtype=torch.int32, device=DEVICE)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    scale = d ** -0.5
    ref = ref_attention(q, k_cache, v_cache, bt, sl, qsl, scale)
    if check_decode_direct:
        out = paged_attention_decode(q, k_cache, v_cache, bt, sl, scale, max(seq_lens), num_splits=num_splits)
    else:
        out = paged_attention(q, k_cache, v_cache, bt, sl, qsl, scale, max(q_lens), max(seq_lens),
                              use_tma=use_tma)
    assert out.shape == (T, hq, d) and out.dtype == dtype
    assert torch.isfinite(out.float()).all()
    err = rel_err(out, ref)
    assert err < TOL[dtype], f"rel err {err}"
    return out, ref


# ----------------------------------------------------------------------------
# store_kv_cache
# ----------------------------------------------------------------------------
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("block_size,dtype", [(4, torch.float32), (16, torch.float16), (1, torch.bfloat16)])
def test_store_kv_cache(slot_dtype, block_size, dtype):
    gen = torch.Generator().manual_seed(1)
    num_blocks, hkv, d, T = 12, 2, 32, 10
    k_cache, v_cache = make_cache(num_blocks, block_size, hkv, d, dtype, gen)
    k0, v0 = k_cache.clone(), v_cache.clone()
    n_slots = num_blocks * block_size
    slots = torch.randperm(n_slots, generator=gen)[:T]
    slots[[2, 7]] = -1  # padding tokens
    # fused-qkv style non-contiguous key/value views
    kv = torch.randn(T, 3 * hkv * d, generator=gen).to(dtype).to(DEVICE)
    key = kv[:, hkv * d: 2 * hkv * d].view(T, hkv, d)
    value = kv[:, 2 * hkv * d:].view(T, hkv, d)
    store_kv_cache(key, value, k_cache, v_cache, slots.to(slot_dtype).to(DEVICE))

    exp_k, exp_v = k0.clone(), v0.clone()
    fk, fv = exp_k.view(n_slots, hkv, d), exp_v.view(n_slots, hkv, d)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            fk[s] = key[t]
            fv[s] = value[t]
    assert torch.equal(k_cache, exp_k)
    assert torch.equal(v_cache, exp_v)


def test_store_kv_cache_fp8():
    """An e4m3 cache (kv_cache_dtype="fp8", scale 1): the reference's saturating cast."""
    from minivllm.model.attention import store_kv_reference

    gen = torch.Generator().manual_seed(3)
    k_cache, v_cache = make_cache(6, 4, 2, 32, torch.float8_e4m3fn, gen)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    key = (torch.randn(9, 2, 32, generator=gen) * 100).to(torch.bfloat16).to(DEVICE)
    value = torch.randn(9, 2, 32, generator=gen).to(torch.bfloat16).to(DEVICE)
    value[0, 0, :3] = torch.tensor([600.0, -1e4, 0.001])
    slots = torch.randperm(24, generator=gen)[:9]
    slots[4] = -1
    slots = slots.to(DEVICE)
    src_k, src_v = k_cache.float(), v_cache.float()
    store_kv_reference(key, value, want_k, want_v, slots)
    store_kv_reference(key.float(), value.float(), src_k, src_v, slots)
    store_kv_cache(key, value, k_cache, v_cache, slots)
    assert_e4m3_matches(k_cache, want_k, src_k)
    assert_e4m3_matches(v_cache, want_v, src_v)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_attention_reads_an_fp8_cache(dtype):
    """Prefill, chunked prefill and split decode over e4m3 K/V, the products in q's dtype:
    as close to the dense reference (of the same e4m3 values) as with a cache in q's
    dtype."""
    run_case([5, 37, 20], [5, 12, 1], 4, 2, 16, 4, dtype, seed=21,
             cache_dtype=torch.float8_e4m3fn)
    run_case([37, 5, 64], [1, 1, 1], 4, 1, 32, 16, dtype, seed=22, check_decode_direct=True,
             num_splits=3, cache_dtype=torch.float8_e4m3fn)


@pytest.mark.gpu  # runs here too; the GPU check's `-m gpu` selection must include it
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float8_e4m3fn])
def test_attention_ignores_nan_past_a_sequence_end(cache_dtype):
    """The slots of a sequence's last block past its end may hold anything (a freed
    request's NaNs): decode and prefill read an e4m3 V tile's tail whole and must not let
    them into the output. (Under the interpreter e4m3's NaN byte reaches no output either
    way; the GPU run of this file is the one that can fail for it.)"""
    gen = torch.Generator().manual_seed(31)
    seq_lens, q_lens, bs, hq, hkv, d = [21, 6, 37], [1, 1, 1], 16, 4, 2, 16
    k_cache, v_cache = make_cache(12, bs, hkv, d, cache_dtype, gen)
    bt = make_block_tables(seq_lens, bs, 12, gen)
    q = torch.randn(5, hq, d, generator=gen).to(DEVICE)  # 1, 1 and 3 query tokens
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    qsl = torch.tensor([0, 1, 2, 5], dtype=torch.int32, device=DEVICE)
    want = ref_attention(q, k_cache, v_cache, bt, sl, qsl, d ** -0.5)
    for i, n in enumerate(seq_lens):
        last = int(bt[i, (n - 1) // bs])
        k_cache[last, n % bs:] = float("nan")
        v_cache[last, n % bs:] = float("nan")
    decode = paged_attention_decode(q[[0, 1, 4]], k_cache, v_cache, bt, sl, d ** -0.5,
                                    max(seq_lens))
    prefill = paged_attention(q, k_cache, v_cache, bt, sl, qsl, d ** -0.5, 3, max(seq_lens))
    for out, ref in ((decode, want[[0, 1, 4]]), (prefill, want)):
        assert torch.isfinite(out).all()
        assert rel_err(out, ref) < TOL[torch.float32]


def test_store_kv_cache_all_padding_and_empty():
    gen = torch.Generator().manual_seed(2)
    k_cache, v_cache = make_cache(4, 4, 1, 16, torch.float32, gen)
    k0, v0 = k_cache.clone(), v_cache.clone()
    key = torch.randn(3, 1, 16, generator=gen).to(DEVICE)
    store_kv_cache(key, key.clone(), k_cache, v_cache, torch.full((3,), -1, dtype=torch.int64, device=DEVICE))
    empty = key[:0]
    store_kv_cache(empty, empty, k_cache, v_cache, torch.zeros(0, dtype=torch.int64, device=DEVICE))
    assert torch.equal(k_cache, k0) and torch.equal(v_cache, v0)


# ----------------------------------------------------------------------------
# prefill / chunked prefill (general varlen kernel)
# ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "hq,hkv,d,block_size,dtype",
    [
        (4, 2, 16, 4, torch.float32),
        (4, 1, 32, 16, torch.float32),
        (2, 2, 16, 1, torch.float32),
        (4, 2, 32, 16, torch.float16),
        (4, 2, 16, 4, torch.bfloat16),
    ],
)
def test_prefill_ragged(hq, hkv, d, block_size, dtype):
    # ragged prompts, crossing block boundaries; pure prefill (ctx == 0)
    q_lens = [5, 1, 19, 9]
    run_case(q_lens, q_lens, hq, hkv, d, block_size, dtype, seed=3)


@pytest.mark.parametrize("hq,hkv,d,block_size,dtype", [
    (4, 2, 16, 4, torch.float32),
    (4, 1, 16, 16, torch.float16),
    (3, 1, 16, 8, torch.float32),  # GQA group of 3 (non power of two)
])
def test_chunked_prefill(hq, hkv, d, block_size, dtype):
    # cached prefixes + new chunks, mixed with a decode row and a qlen-0 row
    seq_lens = [23, 40, 7, 12]
    q_lens = [6, 9, 1, 0]
    run_case(seq_lens, q_lens, hq, hkv, d, block_size, dtype, seed=4, fused_qkv=True)


@pytest.mark.parametrize("seed,hq,hkv,d,block_size,dtype", [
    (20, 7, 1, 16, 8, torch.float32),    # Qwen2.5-like GQA 7
    (21, 8, 2, 64, 32, torch.float16),
    (22, 4, 4, 16, 1, torch.float32),    # MHA, block size 1
    (23, 6, 2, 32, 16, torch.bfloat16),  # GQA 3
    (24, 4, 2, 128, 16, torch.float16),
])
def test_random_mixed_batches(seed, hq, hkv, d, block_size, dtype):
    """Random mixes of fresh prompts, chunked-prefill chunks, decode rows and
    qlen-0 rows, with random lengths."""
    g = torch.Generator().manual_seed(seed)
    n = 5
    seq_lens, q_lens = [], []
    for i in range(n):
        kind = int(torch.randint(0, 4, (1,), generator=g))
        sl = int(torch.randint(1, 50, (1,), generator=g))
        ql = {0: sl, 1: int(torch.randint(1, sl + 1, (1,), generator=g)), 2: 1, 3: 0}[kind]
        seq_lens.append(sl)
        q_lens.append(ql)
    q_lens[0] = max(q_lens[0], 2)  # at least one multi-token row
    seq_lens[0] = max(seq_lens[0], q_lens[0])
    run_case(seq_lens, q_lens, hq, hkv, d, block_size, dtype, seed=seed)
    # the same contexts decoded (one query each), several splits
    run_case(seq_lens, [1] * n, hq, hkv, d, block_size, dtype, seed=seed + 100,
             check_decode_direct=True, num_splits=3)


@pytest.mark.parametrize("hq,hkv,d,block_size,dtype", [
    (4, 2, 32, 16, torch.bfloat16), (3, 1, 16, 32, torch.float16), (2, 2, 64, 16, torch.float16)])
def test_prefill_tiles_through_tensor_descriptors(hq, hkv, d, block_size, dtype):
    """K/V tiles loaded whole through descriptors over the flat cache (one block-table
    entry a tile): ragged prompts, prompts after a cached prefix, decode rows, and
    sequences ending mid-block (the tile's rows past the end masked, their values zeroed)."""
    if DEVICE == "cuda":  # tiles of 64 keys on the GPU
        block_size *= 4
    seq_lens, q_lens = [37, 1, 50, 16, 20], [37, 1, 13, 16, 1]
    run_case(seq_lens, q_lens, hq, hkv, d, block_size, dtype, seed=5, use_tma=True)
    # NaN in a block's rows past the sequence's end must not reach the output.
    gen = torch.Generator().manual_seed(6)
    k_cache, v_cache = make_cache(2, block_size, hkv, d, dtype, gen)
    k_cache[1, 5:], v_cache[1, 5:] = float("nan"), float("nan")
    bt = torch.tensor([[1]], dtype=torch.int32, device=DEVICE)
    sl = torch.tensor([5], dtype=torch.int32, device=DEVICE)
    qsl = torch.tensor([0, 5], dtype=torch.int32, device=DEVICE)
    q = torch.randn(5, hq, d, generator=gen).to(dtype).to(DEVICE)
    out = paged_attention(q, k_cache, v_cache, bt, sl, qsl, d ** -0.5, 5, 5, use_tma=True)
    ref = ref_attention(q, k_cache, v_cache, bt, sl, qsl, d ** -0.5)
    assert torch.isfinite(out.float()).all() and rel_err(out, ref) < TOL[dtype]
    if DEVICE == "cpu":  # the descriptor path needs each tile inside one block
        with pytest.raises(ValueError, match="whole-tile descriptor loads"):
            run_case([20], [20], 2, 1, 16, 8, torch.float16, use_tma=True)


def test_prefill_non_identity_tables_and_out_arg():
    gen = torch.Generator().manual_seed(5)
    hq, hkv, d, bs = 4, 2, 16, 4
    seq_lens, q_lens = [13, 30], [13, 4]
    k_cache, v_cache = make_cache(20, bs, hkv, d, torch.float32, gen)
    bt = make_block_tables(seq_lens, bs, 20, gen, max_blocks=10)  # wider table, junk tail
    q = torch.randn(sum(q_lens), hq, d, generator=gen).to(DEVICE)
    qsl = torch.tensor([0, 13, 17], dtype=torch.int32, device=DEVICE)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    out = torch.full_like(q, float("nan"))
    res = paged_attention(q, k_cache, v_cache, bt, sl, qsl, 0.3, 13, 30, out=out)
    assert res.data_ptr() == out.data_ptr()
    ref = ref_attention(q, k_cache, v_cache, bt, sl, qsl, 0.3)
    assert rel_err(out, ref) < 1e-4


@pytest.mark.parametrize("hq,hkv", [(7, 1), (4, 2)])
def test_prefill_tiles_of_a_padded_mixed_batch(hq, hkv):
    """The prefill kernel's grid covers the batch's row tiles (plus one spare per
    sequence), each program finding its sequence by binary search: a graph-style batch
    with rows before qsl[0] and after qsl[-1], many decode rows, a prefill spanning
    several tiles and qlen-0 padding sequences. Owned rows match the reference; rows of
    no sequence are left as they were."""
    gen = torch.Generator().manual_seed(31)
    d, bs = 16, 4
    seq_lens = [1, 30, 9, 1, 17, 5, 0, 0, 0]
    q_lens = [1, 1, 9, 1, 1, 5, 0, 0, 0]
    lead, tail = 3, 6
    nb = sum(-(-s // bs) for s in seq_lens) + 4
    k_cache, v_cache = make_cache(nb, bs, hkv, d, torch.float32, gen)
    bt = make_block_tables(seq_lens, bs, nb, gen)
    T = lead + sum(q_lens) + tail
    q = torch.randn(T, hq, d, generator=gen).to(DEVICE)
    starts = [lead + sum(q_lens[:i]) for i in range(len(q_lens) + 1)]
    qsl = torch.tensor(starts, dtype=torch.int32, device=DEVICE)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    out = torch.full_like(q, float("nan"))
    paged_attention(q, k_cache, v_cache, bt, sl, qsl, d ** -0.5, max(q_lens), max(seq_lens),
                    out=out)
    ref = ref_attention(q, k_cache, v_cache, bt, sl, qsl, d ** -0.5)
    owned = slice(starts[0], starts[-1])
    assert rel_err(out[owned], ref[owned]) < 1e-4
    assert torch.isnan(out[:lead]).all() and torch.isnan(out[starts[-1]:]).all()


def test_store_then_prefill_roundtrip():
    """store_kv_cache the new tokens of a chunk, then attend over them."""
    gen = torch.Generator().manual_seed(6)
    hq, hkv, d, bs = 4, 2, 16, 4
    num_blocks = 12
    k_cache, v_cache = make_cache(num_blocks, bs, hkv, d, torch.float32, gen)
    seq_lens, q_lens = [10, 6], [3, 6]
    bt = make_block_tables(seq_lens, bs, num_blocks, gen)
    T = sum(q_lens)
    key = torch.randn(T, hkv, d, generator=gen).to(DEVICE)
    value = torch.randn(T, hkv, d, generator=gen).to(DEVICE)
    slots = []
    for i, (sl, ql) in enumerate(zip(seq_lens, q_lens)):
        for p in range(sl - ql, sl):
            slots.append(int(bt[i, p // bs]) * bs + p % bs)
    store_kv_cache(key, value, k_cache, v_cache, torch.tensor(slots, device=DEVICE))
    q = torch.randn(T, hq, d, generator=gen).to(DEVICE)
    qsl = torch.tensor([0, 3, 9], dtype=torch.int32, device=DEVICE)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    out = paged_attention(q, k_cache, v_cache, bt, sl, qsl, d ** -0.5, 6, 10)
    ref = ref_attention(q, k_cache, v_cache, bt, sl, qsl, d ** -0.5)
    assert rel_err(out, ref) < 1e-4
    # the second sequence is a fresh prompt: its last query row must attend
    # exactly to the stored keys/values
    kk = key[3:9].repeat_interleave(2, dim=1)
    vv = value[3:9].repeat_interleave(2, dim=1)
    s = torch.einsum("hd,khd->hk", q[8], kk) * d ** -0.5
    manual = torch.einsum("hk,khd->hd", torch.softmax(s, -1), vv)
    assert torch.allclose(out[8], manual, atol=1e-5, rtol=1e-4)


# ----------------------------------------------------------------------------
# decode (flash-decoding split + reduce)
# ----------------------------------------------------------------------------
@pytest.mark.parametrize("growth", [3.0, 12.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_scores_that_grow_along_the_context(growth, dtype):
    """Keys aligned with every query more and more along the sequence, so each tile's
    maximum score is above the last one's by ~growth (log2 units) and the online softmax
    rescales its running sums at every tile (by 2^-3 or 2^-12). Prefill, chunked prefill
    and decode (with splits) against the reference."""
    # 96 keys: 6 tiles of 16 (the decode's 3 splits 2 each), so every tile after the first
    # rescales, in each split too; the interpreter's cost grows with n squared (prefill).
    hq, hkv, d, block_size, n = 4, 2, 16, 4, 96
    gen = torch.Generator().manual_seed(11)
    u = torch.nn.functional.normalize(torch.randn(d, generator=gen), dim=0)
    blocks = -(-n // block_size)
    pos = torch.arange(blocks * block_size, dtype=torch.float32).view(blocks, block_size, 1, 1)
    # In the interpreter a tile holds 16 keys: q . k * scale * log2(e) rises ~growth a tile.
    ramp = growth / (16 * 3.0 * d ** -0.5 * 1.4427)
    k = 0.3 * torch.randn(blocks, block_size, hkv, d, generator=gen) + pos * ramp * u
    v = torch.randn(blocks, block_size, hkv, d, generator=gen)
    k_cache, v_cache = k.to(dtype).to(DEVICE), v.to(dtype).to(DEVICE)
    tables = torch.arange(blocks, dtype=torch.int32, device=DEVICE)[None]
    for q_len in (n, 37, 1):  # a whole prompt, a chunk after a cached prefix, a decode
        q = (0.3 * torch.randn(q_len, hq, d, generator=gen) + 3.0 * u).to(dtype).to(DEVICE)
        qsl = torch.tensor([0, q_len], dtype=torch.int32, device=DEVICE)
        sl = torch.tensor([n], dtype=torch.int32, device=DEVICE)
        ref = ref_attention(q, k_cache, v_cache, tables, sl, qsl, d ** -0.5)
        outs = [paged_attention(q, k_cache, v_cache, tables, sl, qsl, d ** -0.5, q_len, n)]
        if q_len == 1:
            outs += [paged_attention_decode(q, k_cache, v_cache, tables, sl, d ** -0.5, n,
                                            num_splits=splits) for splits in (1, 3)]
        for out in outs:
            assert torch.isfinite(out.float()).all()
            assert rel_err(out, ref) < TOL[dtype], (q_len, rel_err(out, ref))


@pytest.mark.parametrize("num_splits", [1, 3, 4, None])
@pytest.mark.parametrize("hq,hkv,d,block_size,dtype", [
    (4, 2, 16, 4, torch.float32),
    (4, 1, 32, 16, torch.float16),
])
def test_decode_splits(num_splits, hq, hkv, d, block_size, dtype):
    seq_lens = [37, 5, 64]
    run_case(seq_lens, [1] * len(seq_lens), hq, hkv, d, block_size, dtype, seed=7,
             check_decode_direct=True, num_splits=num_splits)


@pytest.mark.parametrize("block_size,dtype", [(1, torch.float32), (16, torch.bfloat16), (4, torch.float16)])
def test_decode_via_dispatch(block_size, dtype):
    # paged_attention with max_query_len == 1 dispatches to the decode path
    seq_lens = [17, 40]
    run_case(seq_lens, [1, 1], 4, 2, 16, block_size, dtype, seed=8)


def test_decode_padding_rows_zero_len():
    gen = torch.Generator().manual_seed(9)
    hq, hkv, d, bs = 4, 2, 16, 4
    seq_lens = [21, 0, 9, 0]
    num_blocks = 10
    k_cache, v_cache = make_cache(num_blocks, bs, hkv, d, torch.float32, gen)
    bt = make_block_tables(seq_lens, bs, num_blocks, gen)
    bt[1] = 10_000_000  # padding rows: garbage block tables must not be read
    bt[3] = -5
    q = torch.randn(4, hq, d, generator=gen).to(DEVICE)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    qsl = torch.arange(5, dtype=torch.int32, device=DEVICE)
    ref = ref_attention(q, k_cache, v_cache, bt, sl, qsl, 0.25)
    for ns in (1, 4):
        out = torch.full_like(q, float("nan"))
        paged_attention_decode(q, k_cache, v_cache, bt, sl, 0.25, 64, out=out, num_splits=ns)
        assert torch.isfinite(out).all()
        assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.equal(out[3], torch.zeros_like(out[3]))
        assert rel_err(out, ref) < 1e-4


def decode_case(seed, hq, hkv, d, bs, seq_lens, num_blocks):
    """A decode batch over an fp32 cache: q, the caches, block tables, lengths and the
    reference attention."""
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache = make_cache(num_blocks, bs, hkv, d, torch.float32, gen)
    bt = make_block_tables(seq_lens, bs, num_blocks, gen)
    q = torch.randn(len(seq_lens), hq, d, generator=gen).to(DEVICE)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    qsl = torch.arange(len(seq_lens) + 1, dtype=torch.int32, device=DEVICE)
    return q, k_cache, v_cache, bt, sl, ref_attention(q, k_cache, v_cache, bt, sl, qsl, d ** -0.5)


@pytest.mark.parametrize("num_splits", [1, 4, 7])
def test_decode_fused_reduce_matches_the_two_kernel_path(num_splits):
    """With a counters workspace the last split program of each (sequence, kv head)
    combines the splits: same result as the reduce kernel (up to the order of the fp32
    sums), padding rows zero, and the counters zero again after every call."""
    hkv, d, seq_lens = 2, 16, [37, 0, 5, 64, 1]
    q, k_cache, v_cache, bt, sl, ref = decode_case(14, 6, hkv, d, 4, seq_lens, 40)
    two = paged_attention_decode(q, k_cache, v_cache, bt, sl, d ** -0.5, 64,
                                 num_splits=num_splits)
    counters = torch.zeros(len(seq_lens) * hkv + 3, dtype=torch.int32, device=DEVICE)
    for _ in range(2):  # the second call relies on the first one's reset
        out = torch.full_like(q, float("nan"))
        paged_attention_decode(q, k_cache, v_cache, bt, sl, d ** -0.5, 64, out=out,
                               num_splits=num_splits, counters=counters)
        assert torch.equal(counters, torch.zeros_like(counters))
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        assert rel_err(out, ref) < 1e-5 and rel_err(out, two) < 1e-6
    with pytest.raises(ValueError, match="counters"):
        paged_attention_decode(q, k_cache, v_cache, bt, sl, d ** -0.5, 64, num_splits=4,
                               counters=torch.zeros(3, dtype=torch.int32, device=DEVICE))


def test_decode_num_splits_is_static():
    from csrc_triton import decode_num_splits
    a = decode_num_splits(1, 2, 8192)
    assert a == decode_num_splits(1, 2, 8192) and a >= 1
    assert decode_num_splits(256, 8, 1024, "cpu") == 1
    assert decode_num_splits(1, 1, 100) == 1


def test_decode_splits_fill_the_last_wave(monkeypatch):
    """The split count on an H200's 132 SMs (Llama-3.1-8B's 8 kv heads) at the points the
    layer was measured at (docs/decisions.md, "Decode splits by waves"): the fewest splits
    whose last wave of programs is >= 90% full, none past two waves, the most (16) when
    even that leaves the GPU mostly idle."""
    from csrc_triton import decode_min_split_tokens, decode_num_splits
    monkeypatch.setattr(csrc_triton, "_sm_count", lambda device: 132)
    e4m3, bf16 = 3, 4  # programs an SM: 168 and 128 registers a thread, 4 warps
    plan = {(64, 8192, e4m3): 3, (32, 8192, e4m3): 3, (64, 4096, e4m3): 3,
            (16, 4000, e4m3): 3, (128, 2048, e4m3): 1, (96, 8192, e4m3): 1,
            (64, 8192, bf16): 1, (32, 8192, bf16): 2, (16, 4000, bf16): 4,
            (128, 2048, bf16): 1, (1, 8192, bf16): 16, (1, 8192, e4m3): 16,
            (1, 300, bf16): 3, (64, 100, e4m3): 1}
    got = {(b, ctx, per_sm): decode_num_splits(b, 8, ctx, "cuda", per_sm)
           for b, ctx, per_sm in plan}
    assert got == plan
    assert decode_min_split_tokens(64, 8, "cuda", e4m3) == 1024  # >= a wave: balance only
    assert decode_min_split_tokens(32, 8, "cuda", e4m3) == 1  # filling the GPU: a tile


@pytest.mark.parametrize("counted", [False, True])
def test_decode_min_split_tokens(counted):
    """A split takes at least min_split_tokens of context: a sequence shorter than that
    uses one split whatever the grid (bit-identical to an unsplit launch), a longer one
    as many as it fills; the counters are zero after every call."""
    hkv, d, seq_lens = 2, 16, [37, 5, 64, 1, 100]
    q, k_cache, v_cache, bt, sl, ref = decode_case(15, 4, hkv, d, 4, seq_lens, 80)
    counters = torch.zeros(len(seq_lens) * hkv, dtype=torch.int32, device=DEVICE) \
        if counted else None
    one = paged_attention_decode(q, k_cache, v_cache, bt, sl, d ** -0.5, 128, num_splits=1)
    for least in (64, 32):
        out = paged_attention_decode(q, k_cache, v_cache, bt, sl, d ** -0.5, 128,
                                     num_splits=4, counters=counters, min_split_tokens=least)
        short = [i for i, n in enumerate(seq_lens) if n <= least]
        assert torch.equal(out[short], one[short])
        assert rel_err(out, ref) < 1e-5
        if counted:
            assert torch.equal(counters, torch.zeros_like(counters))


# ----------------------------------------------------------------------------
# GPU: realistic shapes (compiled kernels)
# ----------------------------------------------------------------------------
gpu = pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA (compiled Triton)")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("hq,hkv,d", [(14, 2, 64), (32, 8, 64), (16, 8, 128)])
def test_gpu_realistic_prefill_and_chunked(dtype, hq, hkv, d):
    seq_lens = [300, 1024, 77, 513]
    q_lens = [300, 128, 77, 1]
    run_case(seq_lens, q_lens, hq, hkv, d, 16, dtype, seed=11, fused_qkv=True)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_long_prompt_with_query_groups_of_4(dtype):
    """Llama-3.1-8B's heads (32 query, 8 kv, head_dim 128) with a prompt chunk of >= 2,048
    tokens beside a decode row and a cached prefix: the tiles of 128 packed rows that
    _prefill_config gives such a batch, against the reference."""
    from csrc_triton import _prefill_config

    assert _prefill_config(2200, 2300, 4, 128, dtype, False)["BLOCK_M"] == 128
    run_case([2300, 700], [2200, 1], 32, 8, 128, 64, dtype, seed=12, fused_qkv=True)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hq,hkv,d", [(14, 2, 64), (16, 8, 128)])
def test_gpu_descriptor_tiles_equal_gathered_tiles_in_a_graph(dtype, hq, hkv, d):
    """Blocks of 64: the prefill kernel with whole-tile descriptor loads, captured in a CUDA
    graph and replayed on new queries, equals the gathering kernel bit for bit (the same
    tiles, the same arithmetic; only the loads differ)."""
    gen = torch.Generator().manual_seed(14)
    seq_lens, q_lens = [300, 1024, 77, 513, 2000], [300, 128, 77, 1, 1]
    k_cache, v_cache = make_cache(80, 64, hkv, d, dtype, gen)
    bt = make_block_tables(seq_lens, 64, 80, gen)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32,
                       device=DEVICE)
    T = sum(q_lens)
    q = torch.randn(T, hq, d, generator=gen).to(dtype).to(DEVICE)
    out = torch.empty_like(q)

    def attend(use_tma, into):
        return paged_attention(q, k_cache, v_cache, bt, sl, qsl, d ** -0.5, max(q_lens),
                               max(seq_lens), out=into, use_tma=use_tma)
    attend(True, out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        attend(True, out)
    for _ in range(2):
        q.copy_(torch.randn(T, hq, d, generator=gen).to(dtype))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, attend(False, torch.empty_like(q)))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("hq,hkv,d", [(14, 2, 64), (32, 8, 64), (16, 8, 128)])
@pytest.mark.parametrize("batch,ctx", [(1, 8192), (8, 1024), (64, 1000)])
def test_gpu_realistic_decode(dtype, hq, hkv, d, batch, ctx):
    seq_lens = [max(1, ctx - 37 * i) for i in range(batch)]
    run_case(seq_lens, [1] * batch, hq, hkv, d, 16, dtype, seed=12)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("batch,ctx", [(1, 8192), (64, 1000)])
def test_gpu_realistic_decode_fp8_cache(batch, ctx):
    seq_lens = [max(1, ctx - 37 * i) for i in range(batch)]
    run_case(seq_lens, [1] * batch, 32, 8, 128, 16, torch.bfloat16, seed=13,
             cache_dtype=torch.float8_e4m3fn)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("hq,hkv,d", [(14, 2, 64), (32, 8, 64), (16, 8, 128)])
@pytest.mark.parametrize("batch,ctx", [(1, 8192), (1, 300), (8, 1024), (64, 1000)])
def test_gpu_decode_fused_reduce(dtype, hq, hkv, d, batch, ctx):
    """The fused reduce on compiled kernels, where the split programs really run
    concurrently: the counters' release/acquire must make every partial visible."""
    gen = torch.Generator().manual_seed(15)
    seq_lens = [max(1, ctx - 37 * i) for i in range(batch)]
    bs = 16
    num_blocks = sum(-(-s // bs) for s in seq_lens) + 4
    k_cache, v_cache = make_cache(num_blocks, bs, hkv, d, dtype, gen)
    bt = make_block_tables(seq_lens, bs, num_blocks, gen)
    q = torch.randn(batch, hq, d, generator=gen).to(dtype).to(DEVICE)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=DEVICE)
    ref = ref_attention(q, k_cache, v_cache, bt, sl, qsl, d ** -0.5)
    two = paged_attention_decode(q, k_cache, v_cache, bt, sl, d ** -0.5, 8192)
    counters = torch.zeros(batch * hkv, dtype=torch.int32, device=DEVICE)
    for _ in range(20):  # races show up as occasional wrong rows
        out = paged_attention_decode(q, k_cache, v_cache, bt, sl, d ** -0.5, 8192,
                                     counters=counters)
        assert torch.equal(counters, torch.zeros_like(counters))
        assert rel_err(out, two) < (1e-5 if dtype == torch.float32 else 1e-2)
    assert rel_err(out, ref) < (1e-4 if dtype == torch.float32 else 2e-2)


@pytest.mark.gpu
@gpu
def test_gpu_decode_cuda_graph():
    gen = torch.Generator().manual_seed(13)
    hq, hkv, d, bs, B = 32, 8, 64, 16, 8
    max_len = 2048
    num_blocks = B * max_len // bs
    k_cache, v_cache = make_cache(num_blocks, bs, hkv, d, torch.bfloat16, gen)
    bt = make_block_tables([max_len] * B, bs, num_blocks, gen)
    q = torch.randn(B, hq, d, generator=gen).to(torch.bfloat16).to(DEVICE)
    sl = torch.full((B,), 100, dtype=torch.int32, device=DEVICE)
    key = torch.randn(B, hkv, d, generator=gen).to(torch.bfloat16).to(DEVICE)
    slots = torch.zeros(B, dtype=torch.int64, device=DEVICE)
    out = torch.empty_like(q)

    def step():
        store_kv_cache(key, key, k_cache, v_cache, slots)
        paged_attention_decode(q, k_cache, v_cache, bt, sl, d ** -0.5, max_len, out=out)

    step()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    for lens in ([100] * B, [1, 2000, 0, 513, 1024, 7, 0, 2048]):
        sl.copy_(torch.tensor(lens, dtype=torch.int32))
        slots.copy_(torch.tensor([int(bt[i, max(L - 1, 0) // bs]) * bs + max(L - 1, 0) % bs if L > 0 else -1
                                  for i, L in enumerate(lens)]))
        g.replay()
        torch.cuda.synchronize()
        qsl = torch.arange(B + 1, dtype=torch.int32, device=DEVICE)
        ref = ref_attention(q, k_cache, v_cache, bt, sl, qsl, d ** -0.5)
        assert torch.isfinite(out.float()).all()
        assert rel_err(out, ref) < 2e-2


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("weights", ["bf16", "fp8", "int4"])
def test_gpu_kernels_launched_early_equal_plain_launches_in_a_graph(weights, monkeypatch):
    """Programmatic dependent launch (csrc_triton/_pdl.py): four decoder layers at batch 1
    (norm, projections through the GEMV, rotary with the K/V store, decode attention, SiLU),
    every buffer reused by each layer so that a kernel starting early would read stale
    inputs or overwrite what the one before still reads. Captured in a CUDA graph with PDL
    and replayed on new inputs, the output equals the same chain launched plainly."""
    from csrc_triton import (fp8_weight_gemm, fused_add_rms_norm, int4_gemm, linear_gemv,
                             rotary_embedding, silu_and_mul)
    from csrc_triton import _pdl
    from minivllm.model.quantization import GROUP_SIZE, quantize_fp8, quantize_int4

    gen = torch.Generator().manual_seed(21)
    dt, hidden, inter, hq, hkv, d, bs = torch.bfloat16, 512, 1024, 8, 2, 64, 16
    dev = torch.device(DEVICE)

    def rand(*shape, s=1.0):
        return (torch.randn(*shape, generator=gen) * s).to(dt).to(dev)

    def linear(n, k):
        w = rand(n, k, s=k ** -0.5)
        if weights == "bf16":
            return lambda x: linear_gemv(x, w)
        if weights == "fp8":
            q, scale = quantize_fp8(w)
            return lambda x: fp8_weight_gemm(x, q, scale)
        q, scale, zero = quantize_int4(w)
        return lambda x: int4_gemm(x, q, scale, zero, GROUP_SIZE)

    layers = [dict(norm1=rand(hidden), norm2=rand(hidden), qkv=linear((hq + 2 * hkv) * d, hidden),
                   o=linear(hidden, hq * d), gate_up=linear(2 * inter, hidden),
                   down=linear(hidden, inter)) for _ in range(4)]
    k_cache, v_cache = make_cache(64, bs, hkv, d, dt, gen)
    bt = make_block_tables([700], bs, 64, gen)
    seq_lens = torch.tensor([700], dtype=torch.int32, device=dev)
    slot = torch.tensor([int(bt[0, 699 // bs]) * bs + 699 % bs], device=dev)
    pos = torch.tensor([699], device=dev)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    ang = torch.outer(torch.arange(1024).float(), inv)
    cos, sin = torch.cat([ang.cos()] * 2, 1).to(dev), torch.cat([ang.sin()] * 2, 1).to(dev)
    counters = torch.zeros(hkv, dtype=torch.int32, device=dev)
    x_in = rand(1, hidden)
    residual = torch.empty_like(x_in)

    def chain():
        residual.copy_(x_in)
        h = torch.zeros_like(x_in)
        for layer in layers:
            x, _ = fused_add_rms_norm(h, residual, layer["norm1"], 1e-6)
            qkv = layer["qkv"](x).view(1, hq + 2 * hkv, d)
            q, k, v = qkv.split([hq, hkv, hkv], dim=1)
            q, _ = rotary_embedding(pos, q, k, cos, sin, v=v, k_cache=k_cache,
                                    v_cache=v_cache, slot_mapping=slot)
            attn = paged_attention_decode(q, k_cache, v_cache, bt, seq_lens, d ** -0.5, 1024,
                                          num_splits=4, counters=counters)
            h = layer["o"](attn.reshape(1, hq * d))
            x, _ = fused_add_rms_norm(h, residual, layer["norm2"], 1e-6)
            h = layer["down"](silu_and_mul(layer["gate_up"](x)))
        return residual + h

    monkeypatch.setenv("MINIVLLM_PDL", "1")
    assert _pdl.enabled(dev), "this test needs a GPU of compute capability 9 or more"
    chain()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        early = chain()
    for _ in range(3):
        x_in.copy_(rand(1, hidden))
        graph.replay()
        torch.cuda.synchronize()
        monkeypatch.setenv("MINIVLLM_PDL", "0")
        plain = chain()
        monkeypatch.setenv("MINIVLLM_PDL", "1")
        assert torch.isfinite(plain.float()).all()
        assert torch.equal(early, plain)


# ----------------------------------------------------------------------------
# sliding windows and soft-capping (Mistral, Gemma 2/3)
# ----------------------------------------------------------------------------
def ref_windowed(q, k_cache, v_cache, block_tables, seq_lens, qsl, scale, window, softcap):
    """Dense fp32 reference with a sliding window (0: none) and soft-capped scores; the
    block-table entries wholly before a query row's window are not read."""
    T, Hq, D = q.shape
    bs, Hkv = k_cache.shape[1], k_cache.shape[2]
    g = Hq // Hkv
    out = torch.zeros(T, Hq, D, dtype=torch.float32, device=q.device)
    qsl = qsl.tolist()
    for i, sl in enumerate(seq_lens.tolist()):
        s, e = qsl[i], qsl[i + 1]
        if e == s or sl == 0:
            continue
        pos = torch.arange(sl, device=q.device)
        blk = block_tables[i].long()[pos // bs].clamp(min=0)
        k = k_cache[blk, pos % bs].float().repeat_interleave(g, dim=1)
        v = v_cache[blk, pos % bs].float().repeat_interleave(g, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[s:e].float(), k) * scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        qpos = torch.arange(sl - (e - s), sl, device=q.device)[:, None]
        hide = pos[None, :] > qpos
        if window:
            hide |= pos[None, :] <= qpos - window
        p = torch.softmax(scores.masked_fill(hide, float("-inf")), dim=-1)
        out[s:e] = torch.einsum("hqk,khd->qhd", p, v)
    return out


def windowed_case(seq_lens, q_lens, window, block_size, seed, hq=4, hkv=2, d=16,
                  dtype=torch.float32):
    """Caches and tables whose blocks wholly before every query's window are freed (-1),
    as the scheduler leaves them."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + 2
    k_cache, v_cache = make_cache(num_blocks, block_size, hkv, d, dtype, gen)
    bt = make_block_tables(seq_lens, block_size, num_blocks, gen)
    if window:
        for i, (sl, ql) in enumerate(zip(seq_lens, q_lens)):
            first = max(0, sl - ql - window + 1)  # the first query's window start
            bt[i, :first // block_size] = -1
    q = torch.randn(sum(q_lens), hq, d, generator=gen).to(dtype).to(DEVICE)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32,
                       device=DEVICE)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    return q, k_cache, v_cache, bt, sl, qsl


@pytest.mark.gpu  # runs here too; the GPU check's `-m gpu` selection must include it
@pytest.mark.parametrize("window,softcap", [(7, 0.0), (16, 0.0), (40, 0.0), (0, 3.0),
                                            (9, 2.5)])
@pytest.mark.parametrize("block_size", [4, 16])
def test_prefill_with_window_and_softcap(window, softcap, block_size):
    """Chunked prefill rows (a cached context before the chunk), windows shorter and
    longer than the chunk and than a tile, freed blocks before the window."""
    seq_lens, q_lens = [45, 23, 60], [12, 23, 5]
    q, k_cache, v_cache, bt, sl, qsl = windowed_case(seq_lens, q_lens, window, block_size, 3)
    ref = ref_windowed(q, k_cache, v_cache, bt, sl, qsl, 0.3, window, softcap)
    out = paged_attention(q, k_cache, v_cache, bt, sl, qsl, 0.3, max(q_lens), max(seq_lens),
                          window=window, softcap=softcap)
    assert rel_err(out, ref) < 1e-4


@pytest.mark.gpu  # runs here too (see above)
@pytest.mark.parametrize("num_splits", [1, 3, None])
@pytest.mark.parametrize("window,softcap", [(5, 0.0), (16, 0.0), (33, 1.5), (0, 2.0)])
def test_decode_with_window_and_softcap(num_splits, window, softcap):
    seq_lens = [45, 3, 70, 17, 0]
    q, k_cache, v_cache, bt, sl, qsl = windowed_case(seq_lens, [1] * 4 + [0], window, 4, 5)
    q = q[:4]
    seq_lens = seq_lens[:4]
    sl, bt, qsl = sl[:4], bt[:4], qsl[:5]
    ref = ref_windowed(q, k_cache, v_cache, bt, sl, qsl, 0.25, window, softcap)
    counters = torch.zeros(8, dtype=torch.int32, device=DEVICE)
    for c in (None, counters):
        out = paged_attention_decode(q, k_cache, v_cache, bt, sl, 0.25, max(seq_lens),
                                     num_splits=num_splits, counters=c, window=window,
                                     softcap=softcap)
        assert rel_err(out, ref) < 1e-4
