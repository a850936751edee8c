"""Tests of the fused norm / rotary / SwiGLU kernels (csrc_triton/fused.py)
against the eager PyTorch code of ``minivllm.model.layers``.

On a machine without CUDA the kernels run under Triton's interpreter, so the
shapes are tiny.  On a CUDA machine the same tests run compiled on the GPU,
plus the ``@pytest.mark.gpu`` tests with realistic shapes and a CUDA-graph
capture.

Exactness asserted (see ``check``):
* bit-exact for every dtype: rotary embedding (without the fused q/k norm),
  the residual add of ``fused_add_rms_norm``, the KV-cache store.
* RMSNorm outputs (and rotary with fused q/k norm): fp32 within 1e-6
  relative; bf16/fp16 equal except rare 1-ulp flips (the fp32 sum of squares
  is summed in another order than PyTorch's), at most 1 ulp and a small
  fraction of elements.
* silu_and_mul: same as RMSNorm (numpy's exp under the interpreter differs
  from PyTorch's by an fp32 ulp now and then; on CUDA both use expf).
"""

import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")  # conftest.py has chosen the interpreter on CPU-only machines

import csrc_triton  # noqa: E402

from csrc_triton import (fused_add_rms_norm, rms_norm, rms_norm_heads, rotary_embedding,
                         silu_and_mul)
from minivllm.model.attention import store_kv_reference
from minivllm.model.layers import RMSNorm, RotaryEmbedding
from conftest import assert_e4m3_matches  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
DEVICE = "cuda" if (torch.cuda.is_available() and not INTERPRET) else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ULP = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET,
                                reason="needs CUDA (compiled kernels)")


# ----------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------
def check(out, ref, exact, max_flip_frac=0.02, ulps=1, fp32_atol=1e-7):
    """exact: bit-for-bit.  Otherwise fp32 within 1e-6 relative, and
    bf16/fp16 within ``ulps`` ulp on at most ``max_flip_frac`` of the elements."""
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert out.dtype == ref.dtype, (out.dtype, ref.dtype)
    if exact:
        if not torch.equal(out, ref):
            bad = (out != ref).sum().item()
            diff = (out.float() - ref.float()).abs().max().item()
            raise AssertionError(f"not bit-exact: {bad}/{out.numel()} differ, max {diff}")
        return
    o, r = out.float(), ref.float()
    if out.dtype == torch.float32:
        torch.testing.assert_close(o, r, rtol=1e-6, atol=fp32_atol)
        return
    flips = (out != ref).sum().item()
    assert flips <= max_flip_frac * out.numel(), f"{flips}/{out.numel()} elements differ"
    torch.testing.assert_close(o, r, rtol=ulps * ULP[out.dtype], atol=1e-6)


def gen(seed):
    return torch.Generator().manual_seed(seed)


def rand(shape, dtype, g, scale=1.0):
    return (torch.randn(shape, generator=g) * scale).to(dtype).to(DEVICE)


def make_norm(size, dtype, g, eps=1e-6):
    norm = RMSNorm(size, eps)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(size, generator=g) + 0.5)
    return norm.to(device=DEVICE, dtype=dtype)


def fused_qkv(T, hq, hkv, d, dtype, g):
    """q/k/v as non-contiguous views of one [T, (hq + 2 hkv) d] tensor."""
    qkv = rand((T, (hq + 2 * hkv) * d), dtype, g)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    return qkv, q.view(T, hq, d), k.view(T, hkv, d), v.view(T, hkv, d)


# ----------------------------------------------------------------------------
# RMSNorm
# ----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,H", [(0, 64), (1, 64), (7, 64), (5, 48)])
def test_rms_norm(dtype, T, H):
    g = gen(T * 100 + H)
    x = rand((T, H), dtype, g, scale=3.0)
    norm = make_norm(H, dtype, g)
    out = rms_norm(x, norm.weight.data, norm.eps)
    with torch.no_grad():
        check(out, norm(x), exact=False)


def test_rms_norm_out_and_strided_input():
    g = gen(1)
    dtype = torch.bfloat16
    big = rand((6, 100), dtype, g)
    x = big[:, 10:74]  # row stride 100
    norm = make_norm(64, dtype, g)
    with torch.no_grad():
        ref = norm(x)
    out = torch.empty(6, 64, dtype=dtype, device=DEVICE)
    assert rms_norm(x, norm.weight.data, norm.eps, out=out) is out
    check(out, ref, exact=False)
    # in place (out is x)
    xc = x.clone()
    rms_norm(xc, norm.weight.data, norm.eps, out=xc)
    check(xc, ref, exact=False)


def test_rms_norm_fp32_weight_bf16_input():
    """Mixed dtypes promote like PyTorch: bf16 x, fp32 weight -> fp32 out."""
    g = gen(2)
    x = rand((4, 32), torch.bfloat16, g)
    norm = make_norm(32, torch.float32, g)
    out = rms_norm(x, norm.weight.data, norm.eps)
    with torch.no_grad():
        check(out, norm(x), exact=False)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_heads_on_qkv_views(dtype):
    g = gen(3)
    T, hq, hkv, d = 5, 4, 2, 32
    _, q, k, _ = fused_qkv(T, hq, hkv, d, dtype, g)
    qn, kn = make_norm(d, dtype, g), make_norm(d, dtype, g)
    with torch.no_grad():
        check(rms_norm_heads(q, qn.weight.data, qn.eps), qn(q), exact=False)
        check(rms_norm(k, kn.weight.data, kn.eps), kn(k), exact=False)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [0, 1, 6])
def test_fused_add_rms_norm(dtype, T):
    g = gen(10 + T)
    H = 64
    x = rand((T, H), dtype, g)
    residual = rand((T, H), dtype, g, scale=2.0)
    norm = make_norm(H, dtype, g, eps=1e-5)
    with torch.no_grad():
        new_res = residual + x
        ref = norm(new_res)
    res_in = residual.clone()
    out, res_out = fused_add_rms_norm(x, res_in, norm.weight.data, norm.eps)
    assert res_out is res_in  # in place by default
    check(res_out, new_res, exact=True)
    check(out, ref, exact=False)
    # explicit residual_out leaves residual alone; out may alias x
    res_in = residual.clone()
    res_out = torch.empty_like(residual)
    xc = x.clone()
    out2, r2 = fused_add_rms_norm(xc, res_in, norm.weight.data, norm.eps, out=xc,
                                  residual_out=res_out)
    assert out2 is xc and r2 is res_out
    check(res_in, residual, exact=True)
    check(r2, new_res, exact=True)
    check(out2, out, exact=True)


def test_fused_residual_chain_matches_decoder_layers():
    """The wiring pattern: first norm plain, then fused add+norm per sublayer,
    as in ``x = x + attn(norm1(x)); x = x + mlp(norm2(x)); ...; norm(x)``."""
    g = gen(4)
    dtype, T, H, L = torch.bfloat16, 3, 32, 2
    norms = [make_norm(H, dtype, g) for _ in range(2 * L + 1)]
    mats = [rand((H, H), dtype, g, scale=0.3) for _ in range(2 * L)]
    x0 = rand((T, H), dtype, g)
    with torch.no_grad():
        x = x0
        for i in range(2 * L):
            x = x + norms[i](x) @ mats[i]
        ref = norms[-1](x)
        h = rms_norm(x0, norms[0].weight.data, 1e-6)
        residual = x0.clone()
        for i in range(2 * L):
            h, residual = fused_add_rms_norm(h @ mats[i], residual, norms[i + 1].weight.data,
                                             1e-6)
    check(residual, x, exact=False)  # the rare norm flip can propagate through a matmul
    check(h, ref, exact=False)


# ----------------------------------------------------------------------------
# rotary embedding
# ----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,hq,hkv,d", [(0, 4, 2, 32), (1, 4, 2, 64), (9, 4, 2, 16),
                                        (6, 4, 1, 32), (5, 3, 3, 64)])
def test_rotary_embedding(dtype, T, hq, hkv, d):
    g = gen(T * 7 + d)
    rope = RotaryEmbedding(d, 64, 10000.0, None).to(DEVICE)
    qkv, q, k, _ = fused_qkv(T, hq, hkv, d, dtype, g)
    positions = torch.randperm(64, generator=g)[:T].to(DEVICE)
    q_ref, k_ref = rope(positions, q, k)
    q_out, k_out = rotary_embedding(positions, q, k, rope.cos_table, rope.sin_table)
    assert q_out.is_contiguous() and k_out.is_contiguous()
    check(q_out, q_ref, exact=True)
    check(k_out, k_ref, exact=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_in_place_int32_positions_llama3_scaling(dtype):
    g = gen(5)
    T, hq, hkv, d = 7, 4, 2, 32
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}
    rope = RotaryEmbedding(d, 128, 500000.0, scaling).to(DEVICE)
    qkv, q, k, v = fused_qkv(T, hq, hkv, d, dtype, g)
    v_before = v.clone()
    positions = torch.randperm(128, generator=g)[:T].to(torch.int32).to(DEVICE)
    q_ref, k_ref = rope(positions.long(), q, k)
    qo, ko = rotary_embedding(positions, q, k, rope.cos_table, rope.sin_table, q_out=q, k_out=k)
    assert qo is q and ko is k
    check(q, q_ref, exact=True)
    check(k, k_ref, exact=True)
    check(v, v_before, exact=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_with_fused_qk_norm(dtype):
    """Qwen3: rotary(positions, q_norm(q), k_norm(k)) in one launch."""
    g = gen(6)
    T, hq, hkv, d = 5, 4, 2, 32
    rope = RotaryEmbedding(d, 64, 1000000.0, None).to(DEVICE)
    _, q, k, _ = fused_qkv(T, hq, hkv, d, dtype, g)
    qn, kn = make_norm(d, dtype, g), make_norm(d, dtype, g)
    positions = torch.randperm(64, generator=g)[:T].to(DEVICE)
    with torch.no_grad():
        q_ref, k_ref = rope(positions, qn(q), kn(k))
    q_out, k_out = rotary_embedding(positions, q, k, rope.cos_table, rope.sin_table,
                                    q_norm_weight=qn.weight.data, k_norm_weight=kn.weight.data,
                                    eps=1e-6)
    # fp32: the norm's 1e-7 error passes through the rotation (~2 ulp)
    check(q_out, q_ref, exact=False)
    check(k_out, k_ref, exact=False)


@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, None), (torch.bfloat16, None),
                                               (torch.bfloat16, torch.float8_e4m3fn)])
def test_rotary_with_kv_store(dtype, cache_dtype):
    """Also into an e4m3 cache (kv_cache_dtype="fp8"): the reference's saturating cast."""
    g = gen(7)
    T, hq, hkv, d, nb, bs = 6, 4, 2, 16, 5, 4
    rope = RotaryEmbedding(d, 64, 10000.0, None).to(DEVICE)
    _, q, k, v = fused_qkv(T, hq, hkv, d, dtype, g)
    positions = torch.randperm(64, generator=g)[:T].to(DEVICE)
    slots = torch.randperm(nb * bs, generator=g)[:T]
    slots[2] = -1  # padding: not stored
    slots = slots.to(DEVICE)
    k_cache = rand((nb, bs, hkv, d), cache_dtype or dtype, g)
    v_cache = rand((nb, bs, hkv, d), cache_dtype or dtype, g)
    if cache_dtype is not None:
        v[0, 0, :3] = torch.tensor([600.0, -1e4, 447.0])  # past e4m3's range: saturates
    q_ref, k_ref = rope(positions, q, k)
    kc_ref, vc_ref = k_cache.clone(), v_cache.clone()
    kc_src, vc_src = k_cache.float(), v_cache.float()
    store_kv_reference(k_ref, v, kc_ref, vc_ref, slots)
    store_kv_reference(k_ref.float(), v.float(), kc_src, vc_src, slots)
    q_out, k_out = rotary_embedding(positions, q, k, rope.cos_table, rope.sin_table,
                                    v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slots)
    check(q_out, q_ref, exact=True)
    check(k_out, k_ref, exact=True)
    if cache_dtype is None:
        check(k_cache, kc_ref, exact=True)
        check(v_cache, vc_ref, exact=True)
    else:
        assert_e4m3_matches(k_cache, kc_ref, kc_src)
        assert_e4m3_matches(v_cache, vc_ref, vc_src)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_multi_tile_paths(dtype, monkeypatch):
    """Small tiles: heads split over several blocks (the last one partial), as
    happens compiled with many heads (rms grid axis 1, rotary head loop)."""
    from csrc_triton import fused

    monkeypatch.setattr(fused, "_RMS_TILE", {True: 64, False: 64})
    monkeypatch.setattr(fused, "_ROPE_TILE", {True: 32, False: 32})
    g = gen(9)
    T, hq, hkv, d = 3, 5, 3, 32  # rms: 2 heads/block; rotary: 2 heads/tile
    rope = RotaryEmbedding(d, 64, 10000.0, None).to(DEVICE)
    _, q, k, _ = fused_qkv(T, hq, hkv, d, dtype, g)
    qn, kn = make_norm(d, dtype, g), make_norm(d, dtype, g)
    positions = torch.randperm(64, generator=g)[:T].to(DEVICE)
    with torch.no_grad():
        check(rms_norm_heads(q, qn.weight.data, qn.eps), qn(q), exact=False)
        q_ref, k_ref = rope(positions, q, k)
        qo, ko = rotary_embedding(positions, q, k, rope.cos_table, rope.sin_table)
        check(qo, q_ref, exact=True)
        check(ko, k_ref, exact=True)
        q_ref, k_ref = rope(positions, qn(q), kn(k))
        qo, ko = rotary_embedding(positions, q, k, rope.cos_table, rope.sin_table,
                                  q_norm_weight=qn.weight.data, k_norm_weight=kn.weight.data)
        check(qo, q_ref, exact=False)
        check(ko, k_ref, exact=False)


def test_rotary_rejects_bad_args():
    rope = RotaryEmbedding(16, 8, 10000.0, None)
    q = torch.zeros(2, 2, 16)
    with pytest.raises(ValueError):
        rotary_embedding(torch.zeros(1, dtype=torch.long), q, q, rope.cos_table,
                         rope.sin_table)
    with pytest.raises(ValueError):
        rotary_embedding(torch.zeros(2, dtype=torch.long), q, q, rope.cos_table,
                         rope.sin_table, v=q)
    with pytest.raises(TypeError):
        rotary_embedding(torch.zeros(2, dtype=torch.long), q, q.half(), rope.cos_table,
                         rope.sin_table)


# ----------------------------------------------------------------------------
# SwiGLU
# ----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,I", [(0, 48), (1, 64), (6, 48)])
def test_silu_and_mul(dtype, T, I):
    g = gen(T * 3 + I)
    x = rand((T, 2 * I), dtype, g, scale=3.0)
    gate, up = x.chunk(2, dim=-1)
    ref = F.silu(gate) * up
    check(silu_and_mul(x), ref, exact=False)


def test_silu_and_mul_strided_input_and_out():
    g = gen(8)
    dtype = torch.bfloat16
    big = rand((5, 130), dtype, g, scale=3.0)
    x = big[:, 1:129]  # [5, 128], row stride 130
    gate, up = x.chunk(2, dim=-1)
    ref = F.silu(gate) * up
    out = torch.empty(5, 64, dtype=dtype, device=DEVICE)
    assert silu_and_mul(x, out=out) is out
    check(out, ref, exact=False)


# ----------------------------------------------------------------------------
# e4m3 out: a W8A8 projection's input, as fp8_quantize_rows of the 16-bit one
# ----------------------------------------------------------------------------
def check_fp8_rows(got_q, got_scale, from_16_bit):
    """The norm's e4m3 bytes and per-row scales against those of the 16-bit
    result quantized by fp8_quantize_rows: the same fp32 values, divided and rounded alike,
    so equal under the interpreter. Compiled, the kernel writing e4m3 is another kernel
    than the one writing 16 bits, and the norm's sum of squares may be summed in another
    order: a 16-bit value that flips by an ulp (see `check`) can flip its e4m3 byte by
    one step, or a row's scale by a 16-bit ulp (H200: 5 bytes of 16.8 million at T=4096,
    no scale; fp8_fuse_probe.json in 2026-12-02-h200-fp8-fused-activation-quant)."""
    want_q, want_scale = csrc_triton.fp8_quantize_rows(from_16_bit)
    assert got_q.dtype == torch.float8_e4m3fn and got_scale.dtype == torch.float32
    if INTERPRET or DEVICE == "cpu":
        assert torch.equal(got_scale.view(-1), want_scale.view(-1))
        assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8))
        return
    got_scale, want_scale = got_scale.view(-1, 1), want_scale.view(-1, 1)
    torch.testing.assert_close(got_scale, want_scale, rtol=2.0 ** -7, atol=0)
    assert (got_scale != want_scale).sum() <= 1e-3 * got_scale.numel() + 1
    got, want = got_q.float() * got_scale, want_q.float() * want_scale
    # one e4m3 step: 2^-3 of the value in the normal range, 2^-9 x scale below it
    assert ((got - want).abs() <= 2.0 ** -3 * want.abs() + 2.0 ** -9 * want_scale).all()
    assert (got_q.view(torch.uint8) != want_q.view(torch.uint8)).sum() <= 1e-4 * got.numel()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T,H", [(1, 64), (5, 48)])
def test_norms_with_e4m3_out(dtype, T, H):
    g = gen(40 + T + H)
    x, res = rand((T, H), dtype, g, 3.0), rand((T, H), dtype, g, 3.0)
    x[0, 3] = 0.0
    w = make_norm(H, dtype, g).weight.detach()
    q = torch.empty(T, H, dtype=torch.float8_e4m3fn, device=DEVICE)
    scale = torch.empty(T, 1, device=DEVICE)
    assert rms_norm(x, w, 1e-6, out=q, scale_out=scale) is q
    check_fp8_rows(q, scale, rms_norm(x, w, 1e-6))
    new_res = res.clone()
    out, r = fused_add_rms_norm(x, new_res, w, 1e-6, out=q, scale_out=scale)
    assert out is q and torch.equal(r, res + x)
    check_fp8_rows(q, scale, rms_norm(res + x, w, 1e-6))
    with pytest.raises(ValueError, match="scale_out"):
        rms_norm(x, w, 1e-6, out=q)


# ----------------------------------------------------------------------------
# GPU: realistic shapes, CUDA graphs
# ----------------------------------------------------------------------------
def _gpu_rand(shape, dtype, scale=1.0):
    return (torch.randn(shape, device="cuda") * scale).to(dtype)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T", [1, 37, 4096])
@pytest.mark.parametrize("H", [896, 1024, 4096])
def test_gpu_norms(dtype, T, H):
    torch.manual_seed(T + H)
    x = _gpu_rand((T, H), dtype, 3.0)
    res = _gpu_rand((T, H), dtype, 3.0)
    norm = RMSNorm(H, 1e-6).cuda()
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        norm.to(dtype)
        # The reference rounds twice (normalized x to dtype, then times the weight), so a
        # 1-ulp flip of the first rounding can become 2 ulps of the output (seen on the
        # H200: ~1e-5 of the elements at hidden size 4096).
        check(rms_norm(x, norm.weight, 1e-6), norm(x), exact=False, max_flip_frac=1e-3,
              ulps=2)
        new_res = res + x
        out, r = fused_add_rms_norm(x, res.clone(), norm.weight, 1e-6)
        check(r, new_res, exact=True)
        check(out, norm(new_res), exact=False, max_flip_frac=1e-3, ulps=2)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 256, 3000])
@pytest.mark.parametrize("hq,hkv,d,qk_norm", [(14, 2, 64, False), (16, 8, 128, True),
                                               (32, 8, 128, False)])
def test_gpu_rotary(dtype, T, hq, hkv, d, qk_norm):
    torch.manual_seed(T + hq + d)
    rope = RotaryEmbedding(d, 32768, 1000000.0, None).cuda()
    qkv = _gpu_rand((T, (hq + 2 * hkv) * d), dtype)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k = q.view(T, hq, d), k.view(T, hkv, d)
    positions = torch.randint(0, 32768, (T,), device="cuda")
    kw = {}
    with torch.no_grad():
        if qk_norm:
            qn, kn = RMSNorm(d, 1e-6).cuda(), RMSNorm(d, 1e-6).cuda()
            qn.weight.uniform_(0.5, 1.5)
            kn.weight.uniform_(0.5, 1.5)
            qn.to(dtype), kn.to(dtype)
            kw = dict(q_norm_weight=qn.weight, k_norm_weight=kn.weight, eps=1e-6)
            q_ref, k_ref = rope(positions, qn(q), kn(k))
        else:
            q_ref, k_ref = rope(positions, q, k)
    q_out, k_out = rotary_embedding(positions, q, k, rope.cos_table, rope.sin_table, **kw)
    # With the q/k norm, the normalized value's rounding (2 ulps in bf16, as for the norms)
    # meets rotary's x*cos - y*sin, which can cancel to near zero: fp32 gets an absolute
    # tolerance of 1e-6 on inputs of size ~1 (H200: max error 4.8e-7).
    tol = dict(ulps=2, fp32_atol=1e-6) if qk_norm else {}
    check(q_out, q_ref, exact=not qk_norm, max_flip_frac=1e-3, **tol)
    check(k_out, k_ref, exact=not qk_norm, max_flip_frac=1e-3, **tol)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T,I", [(1, 4864), (512, 4864), (64, 14336)])
def test_gpu_silu_and_mul(dtype, T, I):
    torch.manual_seed(T + I)
    x = _gpu_rand((T, 2 * I), dtype, 4.0)
    gate, up = x.chunk(2, dim=-1)
    # expected bit-exact on CUDA (expf + IEEE division, as PyTorch); allow rare flips
    check(silu_and_mul(x), F.silu(gate) * up, exact=False, max_flip_frac=1e-4)


@gpu
@needs_cuda
@pytest.mark.parametrize("T", [33, 4096])
def test_gpu_e4m3_outputs(T):
    """Llama-3.1-8B's hidden size, 4,096."""
    torch.manual_seed(T)
    x, res = _gpu_rand((T, 4096), torch.bfloat16, 3.0), _gpu_rand((T, 4096), torch.bfloat16)
    w = torch.rand(4096, device="cuda").to(torch.bfloat16) + 0.5
    q = torch.empty(T, 4096, dtype=torch.float8_e4m3fn, device="cuda")
    scale = torch.empty(T, 1, device="cuda")
    fused_add_rms_norm(x, res.clone(), w, 1e-6, out=q, scale_out=scale)
    check_fp8_rows(q, scale, rms_norm(res + x, w, 1e-6))


@gpu
@needs_cuda
def test_gpu_cuda_graph_capture():
    """All kernels captured in one CUDA graph and replayed on new inputs."""
    dtype, T, H, hq, hkv, d, I = torch.bfloat16, 8, 896, 14, 2, 64, 4864
    rope = RotaryEmbedding(d, 4096, 1000000.0, None).cuda()
    w = torch.rand(H, device="cuda").to(dtype) + 0.5
    x = _gpu_rand((T, H), dtype)
    res = _gpu_rand((T, H), dtype)
    qkv = _gpu_rand((T, (hq + 2 * hkv) * d), dtype)
    gu = _gpu_rand((T, 2 * I), dtype)
    positions = torch.randint(0, 4096, (T,), device="cuda")

    def step():
        h, r = fused_add_rms_norm(x, res, w, 1e-6, residual_out=torch.empty_like(res))
        q, k, _ = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
        qo, ko = rotary_embedding(positions, q.view(T, hq, d), k.view(T, hkv, d),
                                  rope.cos_table, rope.sin_table)
        return h, r, qo, ko, silu_and_mul(gu), rms_norm(h, w, 1e-6)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # compile / warm up outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for src in (x, res, qkv, gu):
        src.copy_(torch.randn_like(src, dtype=torch.float32).to(dtype))
    positions.copy_(torch.randint(0, 4096, (T,), device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(outs, step()):
        check(got, want, exact=True)
