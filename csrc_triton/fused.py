"""Fused elementwise / normalization Triton kernels for the decoder layers.

Public API (re-exported by ``csrc_triton``)
-------------------------------------------
rms_norm(x, weight, eps, out=None) -> out
fused_add_rms_norm(x, residual, weight, eps, out=None, residual_out=None) -> (out, residual_out)
rms_norm_heads(x, weight, eps, out=None) -> out
rotary_embedding(positions, q, k, cos_table, sin_table, q_out=None, k_out=None,
                 q_norm_weight=None, k_norm_weight=None, eps=1e-6,
                 v=None, k_cache=None, v_cache=None, slot_mapping=None) -> (q_out, k_out)
silu_and_mul(x, out=None) -> out

They replace the chains of small PyTorch kernels in ``minivllm.model.layers``
(RMSNorm, RotaryEmbedding, the SwiGLU product, residual adds) with one launch
each, and reproduce the *eager PyTorch* numerics of that code: arithmetic is
done in fp32 and the result is rounded to the activation dtype exactly where
PyTorch's separate ops round (round-to-nearest-even).  For bf16/fp16 this
makes every step that does not involve a reduction or a transcendental
function bit-exact; see each function for what is and is not exact.

All launches are free of host syncs and their grids depend only on shapes,
so they can be captured in CUDA graphs.  T == 0 launches nothing.

Module loading follows ``csrc_triton/__init__.py``: CUDA tensors use this
module's kernels (compiled, or interpreted if ``TRITON_INTERPRET=1`` was set
when it was imported); CPU tensors always use a second copy of this file
loaded under ``TRITON_INTERPRET=1`` (Triton's interpreter; slow, tests only).
Under the interpreter bf16 casts truncate instead of rounding, so the kernels
round to bf16 by hand there (``_numerics.rne_bf16``); compiled kernels use the native
round-to-nearest-even conversion.  Compiled launches pass
``enable_fp_fusion=False`` so no multiply-add is contracted into an FMA that
PyTorch would not use.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from csrc_triton._interpret import jit_helpers, kernels_for
from csrc_triton._pdl import launch_args as pdl_args

_fp8_cast = jit_helpers("_fp8_cast")
_pdl = jit_helpers("_pdl")
_numerics = jit_helpers("_numerics")
_round = _numerics.round_to

try:  # CUDA's own rsqrtf (what PyTorch's CUDA kernels call)
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - very old triton
    libdevice = None

__all__ = [
    "rms_norm",
    "fused_add_rms_norm",
    "rms_norm_heads",
    "rotary_embedding",
    "silu_and_mul",
]

# dtype codes passed to the kernels as constexprs
_F32, _F16, _BF16 = 0, 1, 2
_DT_CODE = {torch.float32: _F32, torch.float16: _F16, torch.bfloat16: _BF16}
_MAX_BLOCK = 65536
# elements per program tile, {interpreted: ..., compiled: ...}; rows (heads)
# are grouped into one program up to this size
_RMS_TILE = {True: 8192, False: 4096}
_ROPE_TILE = {True: 8192, False: 2048}


# ============================================================================
# kernels
# ============================================================================
@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _row_sum(x, INTERPRETED: tl.constexpr):
    """Sum over axis 1.  Under the interpreter, tl.sum is unusable when
    triton itself was imported without TRITON_INTERPRET=1 (it is then a
    compiled-only @jit helper), so reduce with our own combine function."""
    if INTERPRETED:
        s = tl.reduce(x, 1, _add)
    else:
        s = tl.sum(x, axis=1)
    return s


@triton.jit
def _max(a, b):
    return tl.maximum(a, b)


@triton.jit
def _row_max(x, INTERPRETED: tl.constexpr):
    """Maximum over axis 1 (by our own combine function when interpreted, as _row_sum)."""
    if INTERPRETED:
        m = tl.reduce(x, 1, _max)
    else:
        m = tl.max(x, axis=1)
    return m


@triton.jit
def _inv_rms(sumsq, eps, inv_d, d_f, INTERPRETED: tl.constexpr):
    """rsqrt(mean(x^2) + eps) as PyTorch computes it: on CPU mean = sum / n
    and rsqrt = 1 / sqrt; on CUDA mean = sum * (1/n) and rsqrt = rsqrtf."""
    if INTERPRETED:
        r = 1.0 / tl.sqrt(sumsq / d_f + eps)
    else:
        r = libdevice.rsqrt(sumsq * inv_d + eps)
    return r


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, scale_ptr,
    R, D, eps, inv_d, d_f,
    sx_t, sx_r, sx_d,
    sr_t, sr_r, sr_d,
    so_t, so_r, so_d,
    sro_t, sro_r, sro_d,
    HAS_RES: tl.constexpr, X_DT: tl.constexpr, OUT_DT: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, INTERPRETED: tl.constexpr,
    FP8_OUT: tl.constexpr = False, PDL: tl.constexpr = False,
):
    # x viewed as [T, R, D]; program (t, rb) normalizes rows t, rb*BLOCK_R.. over D.
    # FP8_OUT: the result (rounded to OUT_DT first) goes out in e4m3, each row scaled so
    # its absolute maximum is 448, the scale into scale_ptr[t * R + r] (W8A8's input).
    _pdl.wait_for_previous(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs_r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_r[:, None] < R) & (offs_d[None, :] < D)
    x = tl.load(x_ptr + t * sx_t + offs_r[:, None] * sx_r + offs_d[None, :] * sx_d,
                mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        res = tl.load(res_ptr + t * sr_t + offs_r[:, None] * sr_r + offs_d[None, :] * sr_d,
                      mask=mask, other=0.0).to(tl.float32)
        x = _round(res + x, X_DT, INTERPRETED)  # PyTorch's `residual + x` in dtype
        tl.store(res_out_ptr + t * sro_t + offs_r[:, None] * sro_r + offs_d[None, :] * sro_d,
                 x.to(res_out_ptr.dtype.element_ty), mask=mask)
    r = _inv_rms(_row_sum(x * x, INTERPRETED), eps, inv_d, d_f, INTERPRETED)
    n = _round(x * r[:, None], X_DT, INTERPRETED)           # x32.to(in_dtype)
    w = tl.load(w_ptr + offs_d, mask=offs_d < D, other=0.0).to(tl.float32)
    y = _round(w[None, :] * n, OUT_DT, INTERPRETED)           # weight * n
    if FP8_OUT:
        scale = tl.maximum(_row_max(tl.abs(y), INTERPRETED) / 448.0, 1e-12)
        tl.store(scale_ptr + t * R + offs_r, scale, mask=offs_r < R)
        y = _fp8_cast.activation_bytes(y, scale[:, None], INTERPRETED)
    tl.store(out_ptr + t * so_t + offs_r[:, None] * so_r + offs_d[None, :] * so_d,
             y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_heads(
    in_ptr, out_ptr, w_ptr, cache_ptr, t, cache_row, slot_ok,
    c1, s1, c2, s2, eps, inv_d, d_f,
    s_t, s_h, s_d, so_t, so_h, so_d, sc_h, sc_d,
    H: tl.constexpr, HALF: tl.constexpr, HAS_NORM: tl.constexpr, DT: tl.constexpr,
    STORE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """Rotate all H heads of token t (optionally RMS-normalizing each head
    first): out = x*cos + cat(-x2, x1)*sin, each product and the sum rounded
    to DT like PyTorch's separate ops.  With STORE, the result also goes to
    the KV cache row ``cache_ptr + cache_row`` where ``slot_ok``."""
    offs = tl.arange(0, BLOCK_HALF)
    dmask = offs < HALF
    if HAS_NORM:
        w1 = tl.load(w_ptr + offs, mask=dmask, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + offs, mask=dmask, other=0.0).to(tl.float32)
    for h0 in tl.static_range(0, H, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        mask = (offs_h[:, None] < H) & dmask[None, :]
        src = in_ptr + t * s_t + offs_h[:, None] * s_h + offs[None, :] * s_d
        x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF * s_d, mask=mask, other=0.0).to(tl.float32)
        if HAS_NORM:
            r = _inv_rms(_row_sum(x1 * x1, INTERPRETED) + _row_sum(x2 * x2, INTERPRETED),
                         eps, inv_d, d_f, INTERPRETED)
            x1 = _round(w1[None, :] * _round(x1 * r[:, None], DT, INTERPRETED), DT, INTERPRETED)
            x2 = _round(w2[None, :] * _round(x2 * r[:, None], DT, INTERPRETED), DT, INTERPRETED)
        o1, o2 = _numerics.rotate(x1, x2, c1, s1, c2, s2, DT, INTERPRETED)
        dst = out_ptr + t * so_t + offs_h[:, None] * so_h + offs[None, :] * so_d
        tl.store(dst, o1.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + HALF * so_d, o2.to(out_ptr.dtype.element_ty), mask=mask)
        if STORE:
            cmask = mask & slot_ok[:, None]
            cdst = cache_ptr + cache_row[:, None] + offs_h[:, None] * sc_h + offs[None, :] * sc_d
            tl.store(cdst, _fp8_cast.to_cache(o1, cache_ptr.dtype.element_ty), mask=cmask)
            tl.store(cdst + HALF * sc_d, _fp8_cast.to_cache(o2, cache_ptr.dtype.element_ty), mask=cmask)


@triton.jit
def _rotary_kernel(
    pos_ptr, q_ptr, k_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr, qw_ptr, kw_ptr,
    v_ptr, kc_ptr, vc_ptr, slot_ptr,
    max_pos, eps, inv_d, d_f,
    sq_t, sq_h, sq_d, sk_t, sk_h, sk_d,
    sqo_t, sqo_h, sqo_d, sko_t, sko_h, sko_d,
    scos_p, scos_d, ssin_p, ssin_d,
    sv_t, sv_h, sv_d,
    skc_b, skc_s, skc_h, skc_d, svc_b, svc_s, svc_h, svc_d,
    HQ: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr,
    HAS_NORM: tl.constexpr, DT: tl.constexpr, STORE_KV: tl.constexpr,
    CACHE_BLOCK_SIZE: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_HALF: tl.constexpr,
    INTERPRETED: tl.constexpr, PDL: tl.constexpr = False,
):
    _pdl.wait_for_previous(PDL)
    t = tl.program_id(0).to(tl.int64)
    # Out-of-range positions are clamped (no host check: CUDA-graph safe).
    pos = tl.load(pos_ptr + t).to(tl.int64)
    pos = tl.minimum(tl.maximum(pos, 0), max_pos - 1)
    offs = tl.arange(0, BLOCK_HALF)
    dmask = offs < HALF
    # cos/sin = table[positions].to(dtype), each half kept as stored
    cbase = cos_ptr + pos * scos_p
    sbase = sin_ptr + pos * ssin_p
    c1 = tl.load(cbase + offs * scos_d, mask=dmask, other=0.0).to(tl.float32)
    c2 = tl.load(cbase + (HALF + offs) * scos_d, mask=dmask, other=0.0).to(tl.float32)
    s1 = tl.load(sbase + offs * ssin_d, mask=dmask, other=0.0).to(tl.float32)
    s2 = tl.load(sbase + (HALF + offs) * ssin_d, mask=dmask, other=0.0).to(tl.float32)
    c1 = _round(c1, DT, INTERPRETED)[None, :]
    c2 = _round(c2, DT, INTERPRETED)[None, :]
    s1 = _round(s1, DT, INTERPRETED)[None, :]
    s2 = _round(s2, DT, INTERPRETED)[None, :]
    # KV-cache slot of this token, broadcast over the head axis (a scalar &
    # tensor mask trips the interpreter); negative slot = padding, not stored.
    if STORE_KV:
        slot = tl.load(slot_ptr + t).to(tl.int64) + tl.zeros([BLOCK_HKV], dtype=tl.int64)
    else:
        slot = tl.full([BLOCK_HKV], -1, dtype=tl.int64)
    slot_ok = slot >= 0
    slot = tl.where(slot_ok, slot, 0)
    blk = slot // CACHE_BLOCK_SIZE
    off = slot % CACHE_BLOCK_SIZE
    _rope_heads(q_ptr, qo_ptr, qw_ptr, qo_ptr, t, blk, slot_ok, c1, s1, c2, s2, eps, inv_d, d_f,
                sq_t, sq_h, sq_d, sqo_t, sqo_h, sqo_d, 0, 0,
                HQ, HALF, HAS_NORM, DT, False, BLOCK_HQ, BLOCK_HALF, INTERPRETED)
    _rope_heads(k_ptr, ko_ptr, kw_ptr, kc_ptr, t, blk * skc_b + off * skc_s, slot_ok,
                c1, s1, c2, s2, eps, inv_d, d_f,
                sk_t, sk_h, sk_d, sko_t, sko_h, sko_d, skc_h, skc_d,
                HKV, HALF, HAS_NORM, DT, STORE_KV, BLOCK_HKV, BLOCK_HALF, INTERPRETED)
    if STORE_KV:  # v goes to the cache unchanged
        offs_d = tl.arange(0, 2 * BLOCK_HALF)
        vrow = blk * svc_b + off * svc_s
        for h0 in tl.static_range(0, HKV, BLOCK_HKV):
            offs_h = h0 + tl.arange(0, BLOCK_HKV)
            m = (offs_h[:, None] < HKV) & (offs_d[None, :] < 2 * HALF)
            v = tl.load(v_ptr + t * sv_t + offs_h[:, None] * sv_h + offs_d[None, :] * sv_d,
                        mask=m, other=0.0)
            tl.store(vc_ptr + vrow[:, None] + offs_h[:, None] * svc_h + offs_d[None, :] * svc_d,
                     _fp8_cast.to_cache(v, vc_ptr.dtype.element_ty), mask=m & slot_ok[:, None])


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, I,
    sx_t, sx_d, so_t, so_d,
    DT: tl.constexpr, BLOCK: tl.constexpr, INTERPRETED: tl.constexpr,
    PDL: tl.constexpr = False,
):
    _pdl.wait_for_previous(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    row = x_ptr + t * sx_t
    g = tl.load(row + offs * sx_d, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(row + (offs + I) * sx_d, mask=mask, other=0.0).to(tl.float32)
    y = _numerics.silu_mul(g, u, DT, INTERPRETED)
    tl.store(out_ptr + t * so_t + offs * so_d, y.to(out_ptr.dtype.element_ty), mask=mask)


# ============================================================================
# module selection (compiled for CUDA, interpreted for CPU)
# ============================================================================
def _kernels_for(device: torch.device):
    """(kernel module, interpreted?) for tensors on ``device``."""
    return kernels_for(__name__, device)


def _launch_opts(interpreted: bool, num_warps: int, device: torch.device) -> dict:
    """Launch options, and the PDL argument (docs: csrc_triton/_pdl.py)."""
    if interpreted:
        return {}
    return {"num_warps": num_warps, "enable_fp_fusion": False, **pdl_args(device)}


# ============================================================================
# helpers
# ============================================================================
def _next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def _warps(elems: int) -> int:
    # one tile per program: about 16 elements per thread, 1..16 warps
    return int(min(16, max(1, elems // 512)))


def _dt(dtype: torch.dtype, what: str) -> int:
    code = _DT_CODE.get(dtype)
    if code is None:
        raise TypeError(f"{what}: unsupported dtype {dtype} (fp32, fp16 and bf16 are)")
    return code


def _norm_consts(d: int) -> tuple[float, float]:
    """(1/d rounded to fp32 as CUDA's mean computes it, float(d))."""
    return float(np.float32(1.0) / np.float32(d)), float(d)


def _as_3d(x: torch.Tensor, name: str) -> torch.Tensor:
    if x.dim() == 2:
        return x.unsqueeze(1)
    if x.dim() == 3:
        return x
    raise ValueError(f"{name} must be 2-D [T, H] or 3-D [T, heads, D], got {tuple(x.shape)}")


def _check_block(d: int, name: str) -> int:
    block = _next_pow2(d)
    if block > _MAX_BLOCK:
        raise ValueError(f"{name}: normalized size {d} exceeds {_MAX_BLOCK}")
    return block


# ============================================================================
# RMSNorm
# ============================================================================
def _rms_launch(x, residual, weight, eps, out, residual_out, scale_out=None):
    x3 = _as_3d(x, "x")
    T, R, D = x3.shape
    if weight.dim() != 1 or weight.shape[0] != D:
        raise ValueError(f"weight must be [{D}], got {tuple(weight.shape)}")
    if out.shape != x.shape:
        raise ValueError(f"out {tuple(out.shape)} does not match x {tuple(x.shape)}")
    fp8_out = out.dtype == torch.float8_e4m3fn
    if fp8_out and (scale_out is None or scale_out.dtype != torch.float32
                    or scale_out.numel() != T * R or not scale_out.is_contiguous()):
        raise ValueError(f"an e4m3 out needs scale_out: {T * R} contiguous fp32 scales")
    o3 = _as_3d(out.view(torch.uint8) if fp8_out else out, "out")
    if residual is not None:
        r3, ro3 = _as_3d(residual, "residual"), _as_3d(residual_out, "residual_out")
    else:
        r3 = ro3 = x3  # unused
    if T == 0 or R == 0 or D == 0:
        return
    mod, interp = _kernels_for(x.device)
    block_d = _check_block(D, "rms_norm")
    block_r = min(_next_pow2(R), max(1, _RMS_TILE[interp] // block_d))
    inv_d, d_f = _norm_consts(D)
    grid = (T, triton.cdiv(R, block_r))
    mod._rms_norm_kernel[grid](
        x3, r3, weight, o3, ro3, scale_out if fp8_out else weight,
        R, D, float(eps), inv_d, d_f,
        x3.stride(0), x3.stride(1), x3.stride(2),
        r3.stride(0), r3.stride(1), r3.stride(2),
        o3.stride(0), o3.stride(1), o3.stride(2),
        ro3.stride(0), ro3.stride(1), ro3.stride(2),
        HAS_RES=residual is not None, X_DT=_dt(x.dtype, "x"),
        OUT_DT=_dt(torch.promote_types(x.dtype, weight.dtype) if fp8_out else out.dtype, "out"),
        BLOCK_R=block_r, BLOCK_D=block_d, INTERPRETED=interp, FP8_OUT=fp8_out,
        **_launch_opts(interp, _warps(block_r * block_d), x.device),
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             out: torch.Tensor | None = None,
             scale_out: torch.Tensor | None = None) -> torch.Tensor:
    """``RMSNorm.forward``: ``weight * (x32 * rsqrt(mean(x32^2) + eps)).to(x.dtype)``.

    ``x`` is ``[T, H]`` or ``[T, heads, D]`` (any strides, e.g. q/k views of
    a fused qkv tensor); the norm is over the last dim, ``weight`` is
    ``[last dim]``.  The result dtype is ``torch.promote_types(x.dtype,
    weight.dtype)`` as in PyTorch; ``out`` (same shape, any strides, may be
    ``x`` itself) receives it, else a new contiguous tensor is returned.

    Exactness: the normalized value is rounded to x's dtype and the weight
    product rounded again, as PyTorch does.  The only differences come from
    the fp32 sum of squares (another summation order) and, on CUDA, rsqrt:
    fp32 results agree to ~1e-7 relative, bf16/fp16 results are bit-exact
    except for rare 1-ulp flips when that fp32 difference crosses a rounding
    boundary.

    An ``out`` of dtype ``torch.float8_e4m3fn`` takes the result in e4m3, each row
    scaled so that its absolute maximum is 448, the scales into ``scale_out``
    (fp32, one per row): a W8A8 projection's input, the bytes and scales that
    ``fp8_quantize_rows`` of the 16-bit result would give (compiled, up to a step
    where that result's rounding flips as above).
    """
    if out is None:
        out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype),
                          device=x.device)
    _rms_launch(x, None, weight, eps, out, None, scale_out)
    return out


def rms_norm_heads(x: torch.Tensor, weight: torch.Tensor, eps: float,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """Per-head RMSNorm (Qwen3 q_norm / k_norm) of a ``[T, heads, D]`` tensor,
    possibly a strided view; normalizes over D with ``weight`` ``[D]``.
    Same as :func:`rms_norm` on a 3-D input."""
    if x.dim() != 3:
        raise ValueError(f"x must be [T, heads, D], got {tuple(x.shape)}")
    return rms_norm(x, weight, eps, out)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float, out: torch.Tensor | None = None,
                       residual_out: torch.Tensor | None = None,
                       scale_out: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """``new_residual = residual + x``; ``out = rms_norm(new_residual)``.

    Replaces the pair ``x = x + sublayer_out; h = norm(x)``.  ``x`` and
    ``residual`` are ``[T, H]`` of the same dtype.  **In place by default:**
    ``new_residual`` is written into ``residual`` itself unless
    ``residual_out`` is given (it may be any ``[T, H]`` tensor of that dtype;
    it must not partially overlap the inputs).  ``out`` defaults to a new
    tensor; it may be ``x`` itself (vLLM's convention).  Returns
    ``(out, residual_out)``.

    Exactness: the add is rounded to the dtype exactly like PyTorch's add
    (bit-exact); the norm is as :func:`rms_norm`, an e4m3 ``out`` too.
    """
    if x.dim() != 2 or residual.shape != x.shape:
        raise ValueError(f"x {tuple(x.shape)} and residual {tuple(residual.shape)} must be "
                         f"equal [T, H]")
    if residual.dtype != x.dtype:
        raise TypeError(f"x ({x.dtype}) and residual ({residual.dtype}) dtypes differ")
    if residual_out is None:
        residual_out = residual
    elif residual_out.shape != x.shape or residual_out.dtype != x.dtype:
        raise ValueError("residual_out must match x in shape and dtype")
    if out is None:
        out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype),
                          device=x.device)
    _rms_launch(x, residual, weight, eps, out, residual_out, scale_out)
    return out, residual_out


# ============================================================================
# rotary embedding (neox style), optionally fused with Qwen3's q/k norm
# ============================================================================
def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     cos_table: torch.Tensor, sin_table: torch.Tensor,
                     q_out: torch.Tensor | None = None, k_out: torch.Tensor | None = None,
                     q_norm_weight: torch.Tensor | None = None,
                     k_norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
                     v: torch.Tensor | None = None, k_cache: torch.Tensor | None = None,
                     v_cache: torch.Tensor | None = None,
                     slot_mapping: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """``RotaryEmbedding.forward`` (neox style, ``layers._rotate``).

    ``q`` ``[T, Hq, D]`` and ``k`` ``[T, Hkv, D]`` (same dtype; any strides,
    e.g. views of a fused qkv tensor), ``positions`` int ``[>= T]`` (the
    first T are used; values outside ``[0, max_positions)`` are clamped),
    ``cos_table``/``sin_table`` ``[max_positions, D]`` (fp32 normally).
    Computes ``x*cos + cat(-x[..., D/2:], x[..., :D/2])*sin`` with
    ``cos/sin = table[positions].to(q.dtype)``.  Results go to ``q_out`` /
    ``k_out`` when given (any strides; passing ``q``/``k`` themselves rotates
    in place), else to new contiguous tensors.  Returns ``(q_out, k_out)``.

    With ``q_norm_weight``/``k_norm_weight`` (``[D]``, q's dtype) each head
    is first RMS-normalized (Qwen3's q_norm/k_norm), as
    ``rotary(positions, q_norm(q), k_norm(k))`` would, in the same launch.

    With ``v``, ``k_cache``, ``v_cache`` and ``slot_mapping`` (all or none;
    layout as ``csrc_triton.store_kv_cache``), the rotated k and v are also
    written into the paged cache, like ``store_kv_cache(k_out, v, ...)``
    (negative slots skipped), saving that launch.

    Exactness: bit-exact to the PyTorch code for every dtype (each product
    and the sum rounded like PyTorch's ops, no FMA); with the fused norm, the
    norm part is as exact as :func:`rms_norm`.
    """
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"q {tuple(q.shape)} / k {tuple(k.shape)} must be [T, H, D] with "
                         f"equal T and D")
    if k.dtype != q.dtype:
        raise TypeError(f"q ({q.dtype}) and k ({k.dtype}) dtypes differ")
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    if D % 2:
        raise ValueError(f"head_dim {D} must be even")
    if cos_table.dim() != 2 or cos_table.shape[1] != D or sin_table.shape != cos_table.shape:
        raise ValueError(f"cos/sin tables must be [max_positions, {D}], got "
                         f"{tuple(cos_table.shape)} / {tuple(sin_table.shape)}")
    if positions.dim() != 1 or positions.shape[0] < T:
        raise ValueError(f"positions must be 1-D with at least {T} entries")
    has_norm = q_norm_weight is not None
    if has_norm != (k_norm_weight is not None):
        raise ValueError("give both q_norm_weight and k_norm_weight, or neither")
    if has_norm:
        for w in (q_norm_weight, k_norm_weight):
            if w.shape != (D,) or w.dtype != q.dtype:
                raise ValueError(f"norm weights must be [{D}] of dtype {q.dtype}")
    store = [a is not None for a in (v, k_cache, v_cache, slot_mapping)]
    if any(store) and not all(store):
        raise ValueError("give all of v, k_cache, v_cache, slot_mapping, or none")
    store_kv = all(store)
    if store_kv:
        if v.shape != k.shape:
            raise ValueError(f"v {tuple(v.shape)} must match k {tuple(k.shape)}")
        if (k_cache.dim() != 4 or v_cache.shape != k_cache.shape
                or tuple(k_cache.shape[2:]) != (Hkv, D)):
            raise ValueError(f"k_cache/v_cache must be [num_blocks, block_size, {Hkv}, {D}], "
                             f"got {tuple(k_cache.shape)} / {tuple(v_cache.shape)}")
        if slot_mapping.dim() != 1 or slot_mapping.shape[0] < T:
            raise ValueError(f"slot_mapping must be 1-D with at least {T} entries")
    if q_out is None:
        q_out = torch.empty((T, Hq, D), dtype=q.dtype, device=q.device)
    if k_out is None:
        k_out = torch.empty((T, Hkv, D), dtype=k.dtype, device=k.device)
    if q_out.shape != q.shape or k_out.shape != k.shape:
        raise ValueError("q_out/k_out must match q/k in shape")
    if T == 0 or (Hq == 0 and Hkv == 0):
        return q_out, k_out
    mod, interp = _kernels_for(q.device)
    half = D // 2
    block_half = _check_block(half, "rotary_embedding")
    cap = max(1, _ROPE_TILE[interp] // block_half)
    block_hq = max(1, min(_next_pow2(Hq), cap))
    block_hkv = max(1, min(_next_pow2(Hkv), cap))
    inv_d, d_f = _norm_consts(D)
    qw = q_norm_weight if has_norm else q
    kw = k_norm_weight if has_norm else k
    if not store_kv:  # placeholders, never touched
        v, k_cache, v_cache, slot_mapping = k, k_out.unsqueeze(0), k_out.unsqueeze(0), positions
    mod._rotary_kernel[(T,)](
        positions, q, k, cos_table, sin_table, q_out, k_out, qw, kw,
        v, k_cache, v_cache, slot_mapping,
        cos_table.shape[0], float(eps), inv_d, d_f,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        q_out.stride(0), q_out.stride(1), q_out.stride(2),
        k_out.stride(0), k_out.stride(1), k_out.stride(2),
        cos_table.stride(0), cos_table.stride(1), sin_table.stride(0), sin_table.stride(1),
        v.stride(0), v.stride(1), v.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.stride(3),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), v_cache.stride(3),
        HQ=Hq, HKV=Hkv, HALF=half, HAS_NORM=has_norm, DT=_dt(q.dtype, "q"),
        STORE_KV=store_kv, CACHE_BLOCK_SIZE=k_cache.shape[1] if store_kv else 1,
        BLOCK_HQ=block_hq, BLOCK_HKV=block_hkv, BLOCK_HALF=block_half, INTERPRETED=interp,
        **_launch_opts(interp, _warps(2 * max(block_hq, block_hkv) * block_half), q.device),
    )
    return q_out, k_out


# ============================================================================
# SwiGLU
# ============================================================================
def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``F.silu(gate) * up`` for ``x = [gate | up]`` of shape ``[T, 2*I]``
    (the output of the fused gate_up projection; any strides).  Returns
    ``[T, I]`` in x's dtype (into ``out`` when given).

    Exactness: silu is computed in fp32 as PyTorch does (``x / (1 + exp(-x))``;
    compiled kernels use CUDA's expf and an IEEE division, i.e. PyTorch's CUDA
    formula), rounded to the dtype, then the product rounded: bit-exact on
    CUDA by construction; on CPU (interpreter) numpy's exp can differ from
    PyTorch's by an fp32 ulp, which very rarely flips a bf16/fp16 rounding.
    """
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"x must be [T, 2*I], got {tuple(x.shape)}")
    T, I = x.shape[0], x.shape[1] // 2
    if out is None:
        out = torch.empty((T, I), dtype=x.dtype, device=x.device)
    elif out.shape != (T, I):
        raise ValueError(f"out must be [{T}, {I}], got {tuple(out.shape)}")
    if T == 0 or I == 0:
        return out
    mod, interp = _kernels_for(x.device)
    block = min(_next_pow2(I), 4096 if interp else 1024)
    mod._silu_and_mul_kernel[(T, triton.cdiv(I, block))](
        x, out, I, x.stride(0), x.stride(1), out.stride(0), out.stride(1),
        DT=_dt(x.dtype, "x"), BLOCK=block, INTERPRETED=interp,
        **_launch_opts(interp, _warps(block), x.device),
    )
    return out
