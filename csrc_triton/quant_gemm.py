"""Weight-only quantized GEMM: y = x @ dequant(W)^T (+ bias), reading the packed weights;
and the per-token fp8 quantization of W8A8's activations.

Public API (re-exported by ``csrc_triton``)
-------------------------------------------
int8_gemm(x, qweight, scale, bias=None) -> y
    qweight int8 [N, K], scale fp32 [N] (per output channel): W = qweight * scale.
fp8_weight_gemm(x, qweight, scale, bias=None) -> y
    qweight float8_e4m3fn [N, K], scale fp32 [N]: the same with fp8 weights (one token).
int4_gemm(x, qweight, scale, zero, group_size, bias=None) -> y
    qweight uint8 in int4_layout's blocks (two weights per byte), scale fp32 / zero uint8
    (or fp32, for a grid whose zero points have fractions) [N, ceil(K/group_size)]:
    W[n, k] = (q[n, k] - zero[n, k // g]) * scale[n, k // g].
fp8_quantize_rows(x) -> (e4m3 [M, K], fp32 scale [M, 1])
linear_gemv(x, weight, bias=None) -> y
    one row x [1, K] against a 16-bit weight [N, K] through the same GEMV kernel.

x is [M, K] in fp32, fp16 or bf16; y has x's dtype. A single row (batch-1 decode) goes to
a GEMV kernel: element-wise fp32 products over the whole of K in one program, the scale
and bias applied before y is written. More rows go to a tensor-core kernel: each program
dequantizes a [BLOCK_N, BLOCK_K] tile of W in registers (to x's dtype, as a
dequantize-then-matmul would round it) into an fp32 accumulator, and small M splits K
across programs (partial sums in fp32, added in a fixed order: deterministic). Either way
the weights cross memory in their packed size, which at small M is the whole speed-up.
int4 goes its own way by rows of x and shape (16-bit x, integer zero points; int4_path):
up to 32 rows a tensor-core kernel with the weights as the MMA's first operand and K in
slices (_int4_mma_kernel), up to 256 a tile kernel on the tensor cores where its grid
fills the GPU (_int4_mma_tile_kernel), otherwise the weights dequantized by a kernel for
cuBLAS (_int4_dequantized_matmul).

Launches are free of host syncs and their grids depend only on shapes (CUDA-graph safe).
CPU tensors run the kernels through Triton's interpreter (tests only), as in fused.py.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from csrc_triton import _sm_count
from csrc_triton._interpret import jit_helpers, kernels_for
from csrc_triton._pdl import launch_args as pdl_args
from csrc_triton._split_k import split_buffers
from csrc_triton.int4_layout import int4_half, int4_packed_bytes

_fp8_cast = jit_helpers("_fp8_cast")
_pdl = jit_helpers("_pdl")
_split_k = jit_helpers("_split_k")
_numerics = jit_helpers("_numerics")

__all__ = ["int8_gemm", "int4_gemm", "fp8_weight_gemm", "fp8_quantize_rows", "linear_gemv",
           "GemvWeight", "gemv_silu_and_mul", "gemv_rotary"]


# Integer codes to fp32 without I2F (a quarter-rate instruction, the int4 GEMV's limit):
# the code is placed in the mantissa of a float whose exponent makes its unit 1, and the
# float's offset is subtracted.
_MAGIC_U = tl.constexpr(0x4B000000)  # 2^23: bits(2^23 + u) = _MAGIC_U | u for 0 <= u < 2^23
_MAGIC_S = tl.constexpr(0x4B400000)  # 1.5 * 2^23: bits(1.5 * 2^23 + s) = _MAGIC_S + s for |s| < 2^22


@triton.jit
def _int4_codes(b, z, FLOAT_ZERO: tl.constexpr):
    """Packed bytes (uint8) -> (low nibble - z, high nibble - z) in fp32, z already fp32.
    Each code goes into the mantissa of 2^23 and 2^23 + z is subtracted: integer logic and
    one add per weight, where a conversion instruction (I2F) runs at a quarter rate. A
    zero point with a fraction (FLOAT_ZERO: a checkpoint's own grid) would be rounded
    to an integer in 2^23 + z, so there 2^23 and z are subtracted one after the other."""
    b = b.to(tl.int32)
    if FLOAT_ZERO:
        lo = (((b & 0xF) | _MAGIC_U).to(tl.float32, bitcast=True) - 8388608.0) - z
        hi = (((b >> 4) | _MAGIC_U).to(tl.float32, bitcast=True) - 8388608.0) - z
    else:
        z = z + 8388608.0
        lo = ((b & 0xF) | _MAGIC_U).to(tl.float32, bitcast=True) - z
        hi = ((b >> 4) | _MAGIC_U).to(tl.float32, bitcast=True) - z
    return lo, hi


@triton.jit
def _int4_tile(w_ptr, scale_ptr, zero_ptr, offs_n, n_ok, k0, stride_wn, stride_sn,
               GROUP: tl.constexpr, HALF: tl.constexpr, FLOAT_ZERO: tl.constexpr):
    """One packed block of rows offs_n: inputs k0 .. k0 + 2 HALF (k0 a multiple of 2 HALF),
    as (code - zero) of its first half and of its second, and the rows' scales for the
    block's group. Blocks past K are zero padding in the packed rows."""
    offs_j = tl.arange(0, HALF)
    b = tl.load(w_ptr + offs_n[:, None] * stride_wn + (k0 // 2 + offs_j)[None, :],
                mask=n_ok[:, None], other=0)
    g = k0 // GROUP
    s = tl.load(scale_ptr + offs_n * stride_sn + g, mask=n_ok, other=0.0)
    z = tl.load(zero_ptr + offs_n * stride_sn + g, mask=n_ok, other=0).to(tl.float32)
    q_lo, q_hi = _int4_codes(b, z[:, None], FLOAT_ZERO)
    return q_lo, q_hi, s


@triton.jit
def _wq_gemm_kernel(x_ptr, w_ptr, scale_ptr, zero_ptr, out_ptr, M, N, K, stride_xm,
                    stride_wn, stride_sn, stride_os, stride_om, k_per_split,
                    FORMAT: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr,
                    FLOAT_ZERO: tl.constexpr, PDL: tl.constexpr = False):
    """FORMAT 0: int8, 1: fp8 e4m3 (both with a per-channel scale applied at the end),
    2: int4 (two per byte, groups with scale and zero point)."""
    _pdl.wait_for_previous(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * k_per_split
    for k0 in range(k_start, tl.minimum(k_start + k_per_split, K), BLOCK_K):
        if FORMAT == 2:
            # A packed block per step (BLOCK_K = 2 HALF): a product for each half.
            q_lo, q_hi, s = _int4_tile(w_ptr, scale_ptr, zero_ptr, offs_n, n_ok, k0,
                                       stride_wn, stride_sn, GROUP, BLOCK_K // 2,
                                       FLOAT_ZERO)
            w_lo = q_lo * s[:, None]
            w_hi = q_hi * s[:, None]
            k_lo = k0 + tl.arange(0, BLOCK_K // 2)
            x_lo = tl.load(x_ptr + offs_m[:, None] * stride_xm + k_lo[None, :],
                           mask=m_ok[:, None] & (k_lo[None, :] < K), other=0.0)
            x_hi = tl.load(x_ptr + offs_m[:, None] * stride_xm + k_lo[None, :] + BLOCK_K // 2,
                           mask=m_ok[:, None] & (k_lo[None, :] + BLOCK_K // 2 < K), other=0.0)
            if DOT_FP32:
                acc += tl.dot(x_lo.to(tl.float32), tl.trans(w_lo), input_precision="ieee")
                acc += tl.dot(x_hi.to(tl.float32), tl.trans(w_hi), input_precision="ieee")
            else:
                acc += tl.dot(x_lo, tl.trans(w_lo.to(x_lo.dtype)))
                acc += tl.dot(x_hi, tl.trans(w_hi.to(x_hi.dtype)))
        else:
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < K
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                        mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            q = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :],
                        mask=n_ok[:, None] & k_ok[None, :], other=0)
            if FORMAT == 0:
                w = q.to(tl.float32)  # exact; the per-channel scale is applied at the end
            else:
                w = q.to(tl.float8e4nv, bitcast=True).to(tl.float32)
            if DOT_FP32:
                acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
            else:
                acc += tl.dot(x, tl.trans(w.to(x.dtype)))  # int8 and e4m3 fit bf16 exactly
    if FORMAT != 2:
        s = tl.load(scale_ptr + offs_n, mask=n_ok, other=0.0)
        acc = acc * s[None, :]
    tl.store(out_ptr + pid_k * stride_os + offs_m[:, None] * stride_om + offs_n[None, :], acc,
             mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _gemv_weights(w_ptr, offs_n, n_ok, k, K, stride_wn):
    """The codes of rows offs_n at inputs k (8 or 16 bits each)."""
    return tl.load(w_ptr + offs_n[:, None] * stride_wn + k[None, :],
                   mask=n_ok[:, None] & (k < K)[None, :], other=0)


@triton.jit
def _gemv_add(acc, q, x_ptr, k, K, FORMAT: tl.constexpr):
    """acc + the products of codes q (inputs k) with x, element-wise in fp32."""
    if FORMAT == 0:
        w = (q.to(tl.int32) + _MAGIC_S).to(tl.float32, bitcast=True) - 12582912.0
    elif FORMAT == 1:
        w = q.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        w = q.to(tl.float32)
    xk = tl.load(x_ptr + k, mask=k < K, other=0.0).to(tl.float32)
    return acc + w * xk[None, :]


@triton.jit
def _int4_gemv_weights(w_ptr, scale_ptr, zero_ptr, offs_n, n_ok, k0, K, stride_wn, stride_sn,
                       GROUP: tl.constexpr, HALF: tl.constexpr, BLOCKS: tl.constexpr):
    """BLOCKS packed blocks of rows offs_n from input k0: bytes [BLOCK_N, BLOCKS, HALF],
    and each block's scale and zero point [BLOCK_N, BLOCKS]."""
    blk = k0 // (2 * HALF) + tl.arange(0, BLOCKS)
    blk_ok = blk * (2 * HALF) < K
    byte = blk[:, None] * HALF + tl.arange(0, HALF)[None, :]
    b = tl.load(w_ptr + offs_n[:, None, None] * stride_wn + byte[None, :, :],
                mask=n_ok[:, None, None] & blk_ok[None, :, None], other=0)
    sz = offs_n[:, None] * stride_sn + (blk * (2 * HALF) // GROUP)[None, :]
    sz_ok = n_ok[:, None] & blk_ok[None, :]
    s = tl.load(scale_ptr + sz, mask=sz_ok, other=0.0)
    z = tl.load(zero_ptr + sz, mask=sz_ok, other=0)
    return b, s, z


@triton.jit
def _int4_gemv_add(acc, b, s, z, x_ptr, k0, K, HALF: tl.constexpr, BLOCKS: tl.constexpr,
                   FLOAT_ZERO: tl.constexpr):
    """acc + the products of the packed blocks from input k0 with x: each byte's low
    nibble times input j of its block, its high nibble times input HALF + j."""
    lo, hi = _int4_codes(b, z.to(tl.float32)[:, :, None], FLOAT_ZERO)
    blk = k0 // (2 * HALF) + tl.arange(0, BLOCKS)
    k_lo = blk[:, None] * (2 * HALF) + tl.arange(0, HALF)[None, :]
    x_lo = tl.load(x_ptr + k_lo, mask=k_lo < K, other=0.0).to(tl.float32)
    x_hi = tl.load(x_ptr + k_lo + HALF, mask=k_lo + HALF < K, other=0.0).to(tl.float32)
    return acc + (lo * x_lo[None, :, :] + hi * x_hi[None, :, :]) * s[:, :, None]


@triton.jit
def _gemv_rows(x_ptr, w_ptr, scale_ptr, zero_ptr, bias_ptr, offs_n, n_ok, K, stride_wn,
               stride_sn, FORMAT: tl.constexpr, GROUP: tl.constexpr, HALF: tl.constexpr,
               HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               INTERPRETED: tl.constexpr, FLOAT_ZERO: tl.constexpr,
               LOOP_STAGES: tl.constexpr, PDL: tl.constexpr):
    """The GEMV kernels' body: one row of x against weight rows offs_n (any BLOCK_N rows),
    the whole of K, products accumulated element-wise in fp32 and summed over K once at
    the end; returns y [BLOCK_N] in fp32 with the scale and bias applied. FORMAT 0 int8,
    1 fp8, 2 int4, 3 16-bit weights (the model's own, no scale). The first tile of weights
    is loaded before waiting for the previous kernel (PDL), which wrote x. LOOP_STAGES > 1
    (8- and 16-bit weights) pipelines the loop's weight loads through shared memory
    (cp.async, that many tiles in flight); 1 loads each tile when its step starts (plain
    loads, as a plain range compiles). (tl.full, not tl.zeros: the interpreter runs the
    latter, a jitted helper of Triton's, only from a kernel's own body.)"""
    if FORMAT == 2:
        # A tile of BLOCK_K inputs is BLOCKS packed blocks.
        BLOCKS: tl.constexpr = BLOCK_K // (2 * HALF)
        b, s, z = _int4_gemv_weights(w_ptr, scale_ptr, zero_ptr, offs_n, n_ok, 0, K,
                                     stride_wn, stride_sn, GROUP, HALF, BLOCKS)
        _pdl.wait_for_previous(PDL)
        acc = _int4_gemv_add(tl.full((BLOCK_N, BLOCKS, HALF), 0.0, tl.float32), b, s, z,
                             x_ptr, 0, K, HALF, BLOCKS, FLOAT_ZERO)
        for k0 in range(BLOCK_K, K, BLOCK_K):
            b, s, z = _int4_gemv_weights(w_ptr, scale_ptr, zero_ptr, offs_n, n_ok, k0, K,
                                         stride_wn, stride_sn, GROUP, HALF, BLOCKS)
            acc = _int4_gemv_add(acc, b, s, z, x_ptr, k0, K, HALF, BLOCKS, FLOAT_ZERO)
        if INTERPRETED:  # tl.sum is a compiled-only helper here (see fused.py's _row_sum)
            y = tl.reduce(tl.reduce(acc, 2, _add), 1, _add)
        else:
            y = tl.sum(tl.sum(acc, axis=2), axis=1)
    else:
        q = _gemv_weights(w_ptr, offs_n, n_ok, tl.arange(0, BLOCK_K), K, stride_wn)
        _pdl.wait_for_previous(PDL)
        y = _gemv_sum(q, x_ptr, w_ptr, scale_ptr, offs_n, n_ok, K, stride_wn, FORMAT,
                      BLOCK_N, BLOCK_K, INTERPRETED, LOOP_STAGES)
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    return y


@triton.jit
def _gemv_sum(q, x_ptr, w_ptr, scale_ptr, offs_n, n_ok, K, stride_wn, FORMAT: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRETED: tl.constexpr,
              LOOP_STAGES: tl.constexpr):
    """_gemv_rows for 8- and 16-bit codes from the first tile's codes q (loaded before the
    PDL wait): the loop over K, the row sums and the scale."""
    offs_k = tl.arange(0, BLOCK_K)
    acc = _gemv_add(tl.full((BLOCK_N, BLOCK_K), 0.0, tl.float32), q, x_ptr, offs_k, K,
                    FORMAT)
    for k0 in tl.range(BLOCK_K, K, BLOCK_K, num_stages=LOOP_STAGES):
        k = k0 + offs_k
        acc = _gemv_add(acc, _gemv_weights(w_ptr, offs_n, n_ok, k, K, stride_wn), x_ptr,
                        k, K, FORMAT)
    if INTERPRETED:
        y = tl.reduce(acc, 1, _add)
    else:
        y = tl.sum(acc, axis=1)
    if FORMAT != 3:
        y = y * tl.load(scale_ptr + offs_n, mask=n_ok, other=0.0)
    return y


@triton.jit
def _wq_gemv_kernel(x_ptr, w_ptr, scale_ptr, zero_ptr, bias_ptr, out_ptr, N, K, stride_wn,
                    stride_sn, FORMAT: tl.constexpr, GROUP: tl.constexpr, HALF: tl.constexpr,
                    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    INTERPRETED: tl.constexpr, FLOAT_ZERO: tl.constexpr,
                    LOOP_STAGES: tl.constexpr = 1, PDL: tl.constexpr = False):
    """One row of x against BLOCK_N rows of quantized weights (batch-1 decode), y written
    in x's dtype: no partial sums and no second kernel. Tensor cores would pad the one row
    to 16 and shuffle operands for nothing: the weights are only streamed."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    y = _gemv_rows(x_ptr, w_ptr, scale_ptr, zero_ptr, bias_ptr, offs_n, n_ok, K, stride_wn,
                   stride_sn, FORMAT, GROUP, HALF, HAS_BIAS, BLOCK_N, BLOCK_K, INTERPRETED,
                   FLOAT_ZERO, LOOP_STAGES, PDL)
    tl.store(out_ptr + offs_n, y.to(out_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _gemv_silu_kernel(x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, I, K, stride_wn,
                      FORMAT: tl.constexpr, HAS_BIAS: tl.constexpr, DT: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      INTERPRETED: tl.constexpr, LOOP_STAGES: tl.constexpr = 1,
                      PDL: tl.constexpr = False):
    """The batch-1 gate/up projection with SiLU x up as its epilogue: a program's BLOCK_N
    weight rows are BLOCK_N / 2 gate rows and the up rows of the same outputs, interleaved
    (g0 u0 g1 u1 ..., so that one split pairs them); it writes silu(gate) * up [I], the
    bytes the GEMV and silu_and_mul would give (gate and up rounded to x's dtype first)."""
    PAIRS: tl.constexpr = BLOCK_N // 2
    r = tl.arange(0, BLOCK_N)
    outs = tl.program_id(0) * PAIRS + r // 2
    rows, rows_ok = outs + (r % 2) * I, outs < I
    y = _gemv_rows(x_ptr, w_ptr, scale_ptr, scale_ptr, bias_ptr, rows, rows_ok, K,
                   stride_wn, 0, FORMAT, 0, 0, HAS_BIAS, BLOCK_N, BLOCK_K, INTERPRETED,
                   False, LOOP_STAGES, PDL)
    # y as the plain GEMV stores it (the interpreter's cast truncates, so round_to would not)
    y = y.to(x_ptr.dtype.element_ty).to(tl.float32)
    gate, up = tl.split(tl.reshape(y, (PAIRS, 2)))
    o = tl.program_id(0) * PAIRS + tl.arange(0, PAIRS)
    tl.store(out_ptr + o, _numerics.silu_mul(gate, up, DT, INTERPRETED).to(
        out_ptr.dtype.element_ty), mask=o < I)


@triton.jit
def _gemv_rotary_kernel(x_ptr, w_ptr, scale_ptr, bias_ptr, q_ptr, pos_ptr, cos_ptr, sin_ptr,
                        max_pos, slot_ptr, kc_ptr, vc_ptr, skc_b, skc_s, skc_h, skc_d,
                        svc_b, svc_s, svc_h, svc_d, N, K, stride_wn, Q_SIZE, KV_SIZE,
                        HALF_D: tl.constexpr,
                        CACHE_BLOCK_SIZE: tl.constexpr, FORMAT: tl.constexpr,
                        HAS_BIAS: tl.constexpr, DT: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, INTERPRETED: tl.constexpr,
                        LOOP_STAGES: tl.constexpr = 1, PDL: tl.constexpr = False):
    """The batch-1 q/k/v projection with the rotary embedding and the K/V store as its
    epilogue: a program's BLOCK_N weight rows are BLOCK_N / 2 rotary pairs (a head's rows j
    and HALF_D + j, interleaved). q's rows are rotated into q_ptr [Q_SIZE], k's rotated and
    v's as they are into the caches' slot (a negative slot is not stored): the bytes the
    GEMV and rotary_embedding would give (fused.py; cos/sin and every step rounded the
    same way)."""
    PAIRS: tl.constexpr = BLOCK_N // 2
    r = tl.arange(0, BLOCK_N)
    pair = tl.program_id(0) * PAIRS + r // 2
    rows = (pair // HALF_D) * (2 * HALF_D) + pair % HALF_D + (r % 2) * HALF_D
    rows_ok = pair < N // 2
    q = _gemv_weights(w_ptr, rows, rows_ok, tl.arange(0, BLOCK_K), K, stride_wn)
    _pdl.wait_for_previous(PDL)
    # The epilogue's inputs, loaded before the loop so that their latency hides behind it
    # (a kernel before may have written the position and the slot): the position (clamped,
    # as rotary_embedding does), its cos and sin in the dtype, and the KV slot.
    p = tl.program_id(0) * PAIRS + tl.arange(0, PAIRS)
    p_ok = p < N // 2
    j = p % HALF_D
    row = (p // HALF_D) * (2 * HALF_D) + j  # x1's row; x2's is HALF_D further
    pos = tl.load(pos_ptr).to(tl.int64)
    pos = tl.minimum(tl.maximum(pos, 0), max_pos - 1)
    c1 = tl.load(cos_ptr + pos * 2 * HALF_D + j)
    c2 = tl.load(cos_ptr + pos * 2 * HALF_D + HALF_D + j)
    s1 = tl.load(sin_ptr + pos * 2 * HALF_D + j)
    s2 = tl.load(sin_ptr + pos * 2 * HALF_D + HALF_D + j)
    slot = tl.load(slot_ptr).to(tl.int64) + tl.zeros([PAIRS], dtype=tl.int64)
    y = _gemv_sum(q, x_ptr, w_ptr, scale_ptr, rows, rows_ok, K, stride_wn, FORMAT, BLOCK_N,
                  BLOCK_K, INTERPRETED, LOOP_STAGES)
    if HAS_BIAS:
        y += tl.load(bias_ptr + rows, mask=rows_ok, other=0.0).to(tl.float32)
    y = y.to(x_ptr.dtype.element_ty).to(tl.float32)  # as the plain GEMV stores it
    x1, x2 = tl.split(tl.reshape(y, (PAIRS, 2)))
    c1 = _numerics.round_to(c1, DT, INTERPRETED)
    c2 = _numerics.round_to(c2, DT, INTERPRETED)
    s1 = _numerics.round_to(s1, DT, INTERPRETED)
    s2 = _numerics.round_to(s2, DT, INTERPRETED)
    o1, o2 = _numerics.rotate(x1, x2, c1, s1, c2, s2, DT, INTERPRETED)
    is_q = p_ok & (row < Q_SIZE)
    q_row = tl.where(is_q, row, 0)
    tl.store(q_ptr + q_row, o1.to(q_ptr.dtype.element_ty), mask=is_q)
    tl.store(q_ptr + q_row + HALF_D, o2.to(q_ptr.dtype.element_ty), mask=is_q)
    slot_ok = slot >= 0
    slot = tl.where(slot_ok, slot, 0)
    blk = slot // CACHE_BLOCK_SIZE
    off = slot % CACHE_BLOCK_SIZE
    # A cache row's head and dim by its strides (an e4m3 V cache is stored transposed).
    is_k = p_ok & slot_ok & (row >= Q_SIZE) & (row < Q_SIZE + KV_SIZE)
    e = tl.where(is_k, row - Q_SIZE, 0)
    k_dst = (kc_ptr + blk * skc_b + off * skc_s + (e // (2 * HALF_D)) * skc_h
             + (e % (2 * HALF_D)) * skc_d)
    tl.store(k_dst, _fp8_cast.to_cache(o1, kc_ptr.dtype.element_ty), mask=is_k)
    tl.store(k_dst + HALF_D * skc_d, _fp8_cast.to_cache(o2, kc_ptr.dtype.element_ty),
             mask=is_k)
    is_v = p_ok & slot_ok & (row >= Q_SIZE + KV_SIZE)
    e = tl.where(is_v, row - Q_SIZE - KV_SIZE, 0)
    v_dst = (vc_ptr + blk * svc_b + off * svc_s + (e // (2 * HALF_D)) * svc_h
             + (e % (2 * HALF_D)) * svc_d)
    tl.store(v_dst, _fp8_cast.to_cache(x1, vc_ptr.dtype.element_ty), mask=is_v)
    tl.store(v_dst + HALF_D * svc_d, _fp8_cast.to_cache(x2, vc_ptr.dtype.element_ty),
             mask=is_v)


# int4 codes to 16-bit floats for a tensor-core operand, two weights a 32-bit register:
# each byte's nibbles go into the low mantissa bits of 128 (bf16 0x4300) or 1024 (fp16
# 0x6400), whose unit is 1, and one packed FMA subtracts that magic plus the zero point
# (exact: q - z is a small integer). Per 8 weights: 2 PRMT, 2 SHR, 4 LOP3, 4 HFMA2.
_NIBBLES_TO_16BIT_ASM = """{
.reg .b32 t0, t1, u0, u1, one;
mov.b32 one, ONE;
prmt.b32 t0, $4, 0, 0x4140;
prmt.b32 t1, $4, 0, 0x4342;
shr.u32 u0, t0, 4;
shr.u32 u1, t1, 4;
lop3.b32 $0, t0, 0x000F000F, MAGIC, 0xEA;
lop3.b32 $1, t1, 0x000F000F, MAGIC, 0xEA;
lop3.b32 $2, u0, 0x000F000F, MAGIC, 0xEA;
lop3.b32 $3, u1, 0x000F000F, MAGIC, 0xEA;
fma.rn.TYPE $0, $0, one, $5;
fma.rn.TYPE $1, $1, one, $6;
fma.rn.TYPE $2, $2, one, $5;
fma.rn.TYPE $3, $3, one, $6;
}"""
_BF16_NIBBLES_ASM = tl.constexpr(_NIBBLES_TO_16BIT_ASM.replace("ONE", "0x3F803F80").replace(
    "MAGIC", "0x43004300").replace("TYPE", "bf16x2"))
_FP16_NIBBLES_ASM = tl.constexpr(_NIBBLES_TO_16BIT_ASM.replace("ONE", "0x3C003C00").replace(
    "MAGIC", "0x64006400").replace("TYPE", "f16x2"))


@triton.jit
def _int4_mma_operands(b, z, DT: tl.constexpr, INTERPRETED: tl.constexpr):
    """Packed bytes [..., H] and integer zero points [..., 1] -> (low nibbles - z, high
    nibbles - z) in DT (x's 16-bit type), exact. The interpreter's 16-bit arithmetic is
    not, so there the same values come in fp32."""
    if INTERPRETED:
        lo = (b & 0xF).to(tl.float32) - z.to(tl.float32)
        hi = (b >> 4).to(tl.float32) - z.to(tl.float32)
    elif DT == tl.float16:
        zn = tl.broadcast_to((-(z.to(tl.float32) + 1024.0)).to(DT), b.shape)
        lo, hi = tl.inline_asm_elementwise(_FP16_NIBBLES_ASM, "=r,=r,=r,=r,r,r,r", [b, zn],
                                           dtype=(zn.dtype, zn.dtype), is_pure=True, pack=4)
    else:
        zn = tl.broadcast_to((-(z.to(tl.float32) + 128.0)).to(DT), b.shape)
        lo, hi = tl.inline_asm_elementwise(_BF16_NIBBLES_ASM, "=r,=r,=r,=r,r,r,r", [b, zn],
                                           dtype=(zn.dtype, zn.dtype), is_pure=True, pack=4)
    return lo, hi


@triton.jit
def _int4_mma_weights(w_ptr, scale_ptr, zero_ptr, offs_n, n_ok, blk, n_blocks, stride_wn,
                      stride_sn, GROUP: tl.constexpr, HALF: tl.constexpr):
    """Packed blocks blk [S] of rows offs_n: bytes [S, BLOCK_N, HALF], and each block's
    group's scales and zero points [S, BLOCK_N]; zeros past the last block."""
    ok = n_ok[None, :] & (blk < n_blocks)[:, None]
    b = tl.load(w_ptr + offs_n[None, :, None] * stride_wn + (blk * HALF)[:, None, None]
                + tl.arange(0, HALF)[None, None, :], mask=ok[:, :, None], other=0)
    sz = offs_n[None, :] * stride_sn + (blk * 2 * HALF // GROUP)[:, None]
    s = tl.load(scale_ptr + sz, mask=ok, other=0.0)
    z = tl.load(zero_ptr + sz, mask=ok, other=0)
    return b, s, z


@triton.jit
def _int4_mma_add(acc, b, s, z, x_ptr, offs_m, m_ok, blk, K, stride_xm, HALF: tl.constexpr,
                  INTERPRETED: tl.constexpr):
    """acc [S, BLOCK_N, BLOCK_M] + the products of blocks blk [S], one per slice of K:
    (codes - zero) @ x^T per half of a block, in fp32 on the tensor cores, times the
    block's group's scale."""
    k_lo = (blk * 2 * HALF)[:, None] + tl.arange(0, HALF)[None, :]
    x_at = x_ptr + offs_m[None, None, :] * stride_xm + k_lo[:, :, None]
    x_lo = tl.load(x_at, mask=m_ok[None, None, :] & (k_lo < K)[:, :, None], other=0.0)
    x_hi = tl.load(x_at + HALF, mask=m_ok[None, None, :] & (k_lo + HALF < K)[:, :, None],
                   other=0.0)
    w_lo, w_hi = _int4_mma_operands(b, z[:, :, None], x_ptr.dtype.element_ty, INTERPRETED)
    if INTERPRETED:
        p = tl.dot(w_lo, x_lo.to(tl.float32), input_precision="ieee")
        p = tl.dot(w_hi, x_hi.to(tl.float32), p, input_precision="ieee")
    else:
        p = tl.dot(w_lo, x_lo)
        p = tl.dot(w_hi, x_hi, p)
    return acc + p * s[:, :, None]


@triton.jit
def _int4_mma_kernel(x_ptr, w_ptr, scale_ptr, zero_ptr, bias_ptr, out_ptr, part_ptr,
                     count_ptr, M, N, K, stride_xm, stride_wn, stride_sn, stride_om,
                     blocks_per_split, GROUP: tl.constexpr, HALF: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, SLICES: tl.constexpr,
                     SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                     INTERPRETED: tl.constexpr, PDL: tl.constexpr = False):
    """BLOCK_M rows of x against BLOCK_N rows of int4 weights on the tensor cores, the
    weights as the MMA's first operand (the output transposed: its rows are the weights',
    which fill the MMA's 16 rows where a few rows of x would not). K is cut into SLICES
    interleaved slices of packed blocks, each an MMA of its own (a warp's, with a warp
    per slice), summed at the end: enough loads in flight without a second kernel. Each
    packed block is one group: (code - zero) enters the MMA exactly in x's 16-bit type,
    and the group's scale is applied to the block's fp32 product. Integer zero points.
    SPLIT_K > 1: K is also split between programs (grid axis 2, blocks_per_split packed
    blocks each), for projections with few outputs and long rows (down); each writes its
    fp32 partial and the last of a tile's to finish adds them in a fixed order
    (deterministic; _split_k.py) and writes y."""
    pid_n = tl.program_id(0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    split = tl.program_id(2)
    first = split * blocks_per_split
    end = tl.minimum(first + blocks_per_split, tl.cdiv(K, 2 * HALF))
    slice_ = tl.arange(0, SLICES)
    b, s, z = _int4_mma_weights(w_ptr, scale_ptr, zero_ptr, offs_n, n_ok, first + slice_, end,
                                stride_wn, stride_sn, GROUP, HALF)
    _pdl.wait_for_previous(PDL)  # the weights' first blocks are on their way; x is not yet
    acc = _int4_mma_add(tl.zeros((SLICES, BLOCK_N, BLOCK_M), dtype=tl.float32), b, s, z,
                        x_ptr, offs_m, m_ok, first + slice_, K, stride_xm, HALF, INTERPRETED)
    for blk0 in range(first + SLICES, end, SLICES):
        b, s, z = _int4_mma_weights(w_ptr, scale_ptr, zero_ptr, offs_n, n_ok, blk0 + slice_,
                                    end, stride_wn, stride_sn, GROUP, HALF)
        acc = _int4_mma_add(acc, b, s, z, x_ptr, offs_m, m_ok, blk0 + slice_, K, stride_xm,
                            HALF, INTERPRETED)
    if INTERPRETED:  # tl.sum is a compiled-only helper here (see fused.py's _row_sum)
        y = tl.reduce(acc, 0, _add)
    else:
        y = tl.sum(acc, axis=0)
    ok = m_ok[None, :] & n_ok[:, None]
    last = True
    if SPLIT_K > 1:
        y, last = _split_k.sum_of_partials(
            y, part_ptr, count_ptr, tl.program_id(1) * tl.num_programs(0) + pid_n,
            offs_m[None, :] * N + offs_n[:, None], ok, split, M * N, SPLIT_K)
    if last:
        if HAS_BIAS:
            y += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        tl.store(out_ptr + offs_m[None, :] * stride_om + offs_n[:, None],
                 y.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _int4_tile_weights(w_ptr, scale_ptr, zero_ptr, offs_n, n_ok, blk, n_blocks, stride_wn,
                       stride_sn, GROUP: tl.constexpr, HALF: tl.constexpr):
    """Packed block blk of rows offs_n: bytes [BLOCK_N, HALF], the group's scales and zero
    points [BLOCK_N]; zeros past the last block."""
    ok = n_ok & (offs_n * 0 + blk < n_blocks)
    b = tl.load(w_ptr + offs_n[:, None] * stride_wn + blk * HALF + tl.arange(0, HALF)[None, :],
                mask=ok[:, None], other=0)
    g = blk * 2 * HALF // GROUP
    s = tl.load(scale_ptr + offs_n * stride_sn + g, mask=ok, other=0.0)
    z = tl.load(zero_ptr + offs_n * stride_sn + g, mask=ok, other=0)
    return b, s, z


@triton.jit
def _int4_mma_tile_kernel(x_ptr, w_ptr, scale_ptr, zero_ptr, bias_ptr, out_ptr, M, N, K,
                          stride_xm, stride_wn, stride_sn, stride_om, stride_os,
                          blocks_per_split, GROUP: tl.constexpr,
                          HALF: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
                          HAS_BIAS: tl.constexpr, INTERPRETED: tl.constexpr,
                          SPLIT_K: tl.constexpr = 1, PDL: tl.constexpr = False):
    """Many rows of x: a [BLOCK_N, BLOCK_M] tile of the transposed output over the whole of
    K, one packed block (one group) a step, as two plain 2-D MMAs (Hopper's warpgroup MMA
    takes the unpacked weights from registers as its first operand, x's tile from shared
    memory as its second). The group's scale multiplies the 16-bit operands (code - zero,
    exact), so the MMAs accumulate across blocks; scaling each block's fp32 product
    instead (a second fp32 tile, each block waiting for its MMAs) was 2.1-2.5x slower
    with 256 columns of x.
    The next block's weights are loaded before this one is multiplied. Programs next to
    each other share their weights (L2).
    SPLIT_K > 1: program_id(2) takes blocks_per_split blocks of K and writes its fp32
    partial tile at out_ptr + split * stride_os (the launcher sums them and adds the bias):
    more programs where the tiles are few (o and down at 65-128 rows, int4_path)."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    offs_j = tl.arange(0, HALF)
    if SPLIT_K == 1:
        blk_lo = 0
        blk_hi = tl.cdiv(K, 2 * HALF)
    else:
        blk_lo = tl.program_id(2) * blocks_per_split
        blk_hi = tl.minimum(blk_lo + blocks_per_split, tl.cdiv(K, 2 * HALF))
    b, s, z = _int4_tile_weights(w_ptr, scale_ptr, zero_ptr, offs_n, n_ok, blk_lo, blk_hi,
                                 stride_wn, stride_sn, GROUP, HALF)
    _pdl.wait_for_previous(PDL)  # the first block's weights are on their way; x is not yet
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for blk in range(blk_lo, blk_hi):
        b_next, s_next, z_next = _int4_tile_weights(w_ptr, scale_ptr, zero_ptr, offs_n, n_ok,
                                                    blk + 1, blk_hi, stride_wn, stride_sn,
                                                    GROUP, HALF)
        k_lo = blk * 2 * HALF + offs_j
        x_at = x_ptr + offs_m[:, None] * stride_xm + k_lo[None, :]
        x_lo = tl.load(x_at, mask=m_ok[:, None] & (k_lo < K)[None, :], other=0.0)
        x_hi = tl.load(x_at + HALF, mask=m_ok[:, None] & (k_lo + HALF < K)[None, :],
                       other=0.0)
        w_lo, w_hi = _int4_mma_operands(b, z[:, None], x_ptr.dtype.element_ty, INTERPRETED)
        s = s.to(w_lo.dtype)[:, None]  # x's 16-bit type (fp32 in the interpreter)
        if INTERPRETED:
            acc = tl.dot(w_lo * s, tl.trans(x_lo.to(tl.float32)), acc, input_precision="ieee")
            acc = tl.dot(w_hi * s, tl.trans(x_hi.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(w_lo * s, tl.trans(x_lo), acc)
            acc = tl.dot(w_hi * s, tl.trans(x_hi), acc)
        b, s, z = b_next, s_next, z_next
    if HAS_BIAS and SPLIT_K == 1:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + tl.program_id(2) * stride_os + offs_m[None, :] * stride_om
             + offs_n[:, None], acc.to(out_ptr.dtype.element_ty),
             mask=m_ok[None, :] & n_ok[:, None])


@triton.jit
def _int4_dequant_kernel(w_ptr, scale_ptr, zero_ptr, out_ptr, N, K, stride_wn, stride_sn,
                         stride_on, GROUP: tl.constexpr, HALF: tl.constexpr,
                         BLOCK_N: tl.constexpr, FLOAT_ZERO: tl.constexpr,
                         PDL: tl.constexpr = False):
    """One packed block of BLOCK_N rows to x's dtype: W[n, k] = (q - zero) * scale,
    rounded once, in the inputs' own order (for a GEMM of many rows, where the weights
    are read once per step and the product's FLOPs dominate)."""
    _pdl.wait_for_previous(PDL)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    blk = tl.program_id(1)
    n_ok = offs_n < N
    q_lo, q_hi, s = _int4_tile(w_ptr, scale_ptr, zero_ptr, offs_n, n_ok, blk * 2 * HALF,
                               stride_wn, stride_sn, GROUP, HALF, FLOAT_ZERO)
    k_lo = blk * 2 * HALF + tl.arange(0, HALF)
    at = out_ptr + offs_n[:, None] * stride_on + k_lo[None, :]
    dt = out_ptr.dtype.element_ty
    tl.store(at, (q_lo * s[:, None]).to(dt), mask=n_ok[:, None] & (k_lo < K)[None, :])
    tl.store(at + HALF, (q_hi * s[:, None]).to(dt),
             mask=n_ok[:, None] & (k_lo + HALF < K)[None, :])


@triton.jit
def _fp8_rows_kernel(x_ptr, q_ptr, scale_ptr, K, stride_xm, stride_qm, BLOCK_K: tl.constexpr,
                     INTERPRETED: tl.constexpr, PDL: tl.constexpr = False):
    """One row of x: its absolute maximum, then x / scale in e4m3 (as bytes) with scale =
    max / 448, the per-token quantization of W8A8 in one kernel. A row that fits in one
    block (BLOCK_K >= K) is read once and kept in registers; a longer one is read twice,
    a block at a time."""
    _pdl.wait_for_previous(PDL)
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_K)
    if BLOCK_K >= K:
        x = tl.load(x_ptr + row * stride_xm + offs, mask=offs < K, other=0.0).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(x), axis=0) / 448.0, 1e-12)
        tl.store(scale_ptr + row, scale)
        tl.store(q_ptr + row * stride_qm + offs,
                 _fp8_cast.activation_bytes(x, scale, INTERPRETED), mask=offs < K)
    else:
        amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            x = tl.load(x_ptr + row * stride_xm + k0 + offs, mask=k0 + offs < K, other=0.0)
            amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
        scale = tl.maximum(tl.max(amax, axis=0) / 448.0, 1e-12)
        tl.store(scale_ptr + row, scale)
        for k0 in range(0, K, BLOCK_K):
            x = tl.load(x_ptr + row * stride_xm + k0 + offs, mask=k0 + offs < K, other=0.0)
            q = _fp8_cast.activation_bytes(x.to(tl.float32), scale, INTERPRETED)
            tl.store(q_ptr + row * stride_qm + k0 + offs, q, mask=k0 + offs < K)


def _kernels_for(device: torch.device):
    return kernels_for(__name__, device)


def _config(M: int, N: int, K: int, device: torch.device, interpreted: bool):
    """(BLOCK_M, BLOCK_N, BLOCK_K, split_k, num_warps, num_stages). Small M: thin tiles and
    K split until the grid covers the GPU about twice; larger M: square-ish tiles."""
    if interpreted:
        return 16, 16, 32, (2 if K > 64 else 1), 1, 1
    if M <= 64:
        bm = max(16, triton.next_power_of_2(M))
        bn, bk = 64, 128
        tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
        chunks = triton.cdiv(K, bk)
        split = max(1, min(chunks // 4, triton.cdiv(2 * _sm_count(device), tiles), 16))
        return bm, bn, bk, split, 4, 4
    return 128, 128, 64, 1, 8, 3


_FORMATS = {"int8": 0, "fp8": 1, "int4": 2, "w16": 3}


def gemv_config(fmt: str, half: int, N: int, K: int, interpreted: bool = False):
    """(BLOCK_N, BLOCK_K, num_warps, LOOP_STAGES) of the GEMV kernel. 8-bit weights: 8
    rows, 1,024 inputs a step, 4 warps; with more outputs than inputs (many short rows) 4
    rows, 512 inputs, 2 warps. 16-bit: 4 rows, 2,048 inputs (fewer for a shorter row), 4
    warps. int4: 8 rows, whole packed blocks of 2 * half, at least 1,024 inputs. From
    sweeps over Llama-3.1-8B's projections on the H200, their weights cycling through
    copies larger than L2 (docs/decisions.md, bench/diagnostics/gemv_sweep.py). Loop
    stages: fp8's weight loads pipelined 3 deep (down 16.7 us against 17.7, q/k/v 8.8
    against 9.1, o and gate/up level); 16-bit weights and the rest not (3 stages were
    slower for 16-bit, by 0.7-2.5 us a shape)."""
    if interpreted:
        bn, bk, warps = 4, 64, 1
    elif fmt == "w16":
        bn, bk, warps = 4, min(2048, max(64, triton.next_power_of_2(K))), 4
    elif fmt != "int4" and N > K:
        bn, bk, warps = 4, 512, 2
    else:
        bn, bk, warps = 8, 1024, 4
    if fmt == "int4":
        bk = max(bk, 2 * half)
    return bn, bk, warps, 3 if fmt == "fp8" and not interpreted else 1


def _float_zero(zero) -> bool:
    """int4 zero points with fractions (a checkpoint's own grid), not integer codes."""
    return zero is not None and zero.dtype.is_floating_point


def _launch_gemv(mod, interpreted: bool, x: torch.Tensor, w: torch.Tensor,
                 scale: torch.Tensor, zero, bias, fmt: str, group: int, half: int, N: int,
                 config) -> torch.Tensor:
    bn, bk, warps, loop_stages = config
    out = torch.empty((1, N), dtype=x.dtype, device=x.device)
    opts = {} if interpreted else {"num_warps": warps, "num_stages": 2, **pdl_args(x.device)}
    mod._wq_gemv_kernel[(triton.cdiv(N, bn),)](
        x, w, scale, zero if zero is not None else scale, bias if bias is not None else scale,
        out, N, x.shape[1], w.stride(0), scale.stride(0) if fmt == "int4" else 0,
        FORMAT=_FORMATS[fmt], GROUP=group, HALF=half, HAS_BIAS=bias is not None, BLOCK_N=bn,
        BLOCK_K=bk, INTERPRETED=interpreted, FLOAT_ZERO=_float_zero(zero),
        LOOP_STAGES=loop_stages, **opts)
    return out


def int4_mma_config(M: int, N: int, K: int, interpreted: bool = False):
    """(BLOCK_N, BLOCK_M, SLICES, num_warps, num_stages[, splits of K]) of the tensor-core
    int4 kernel: x's rows padded to 8, 16 or 32; 16 weight rows a program, 32 where there
    are 4 times more rows than inputs (gate/up: the grid covers the GPU anyway, and x is
    loaded for twice the rows); K in 4 slices; 4 warps, 3 stages. Rows of 8,192 inputs or
    more at up to 8 rows of x (down: 256 programs for 132 SMs, each walking 14,336 inputs)
    take 8 slices and K split between 2 programs: down at M = 1 15.6 us against 18.0
    unsplit, while splitting q/k/v, o or gate/up made them slower (8.3 -> 9.8, 6.6 -> 7.0,
    25.1 -> 33.4 at best). From sweeps over Llama-3.1-8B's projections at M = 1, 4, 16 and
    32 on the H200 (bench/diagnostics/int4_mma_sweep.py)."""
    bm = 8 if M <= 8 else 16 if M <= 16 else 32
    if interpreted:
        return 16, bm, 2, 1, 1
    bn = 32 if N >= 4 * K else 16
    if K >= 8192 and bm == 8:
        return bn, bm, 8, 4, 3, 2
    return bn, bm, 4, 4, 3


def _launch_int4_mma(mod, interpreted: bool, x: torch.Tensor, w: torch.Tensor,
                     scale: torch.Tensor, zero: torch.Tensor, bias, group: int, half: int,
                     N: int, config, tiles: bool = False) -> torch.Tensor:
    """The sliced kernel (config: BLOCK_N, BLOCK_M, SLICES, warps, stages[, splits of K])
    or with tiles the tile kernel (config: BLOCK_N, BLOCK_M, warps, stages[, splits of
    K])."""
    if tiles:
        return _launch_int4_tiles(mod, interpreted, x, w, scale, zero, bias, group, half, N,
                                  config)
    M, K = x.shape
    bn, bm, slices, warps, stages, *more = config
    n_blocks = triton.cdiv(K, 2 * half)
    # each split whole steps of SLICES blocks
    per_split = triton.cdiv(triton.cdiv(n_blocks, more[0] if more else 1), slices) * slices
    split = triton.cdiv(n_blocks, per_split)
    grid = (triton.cdiv(N, bn), triton.cdiv(M, bm), split)
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    part, counters = (split_buffers(split, M, N, grid[0] * grid[1], x.device, "int4_gemm")
                      if split > 1 else (out, scale))
    opts = {} if interpreted else {"num_warps": warps, "num_stages": stages,
                                   **pdl_args(x.device)}
    mod._int4_mma_kernel[grid](
        x, w, scale, zero, bias if bias is not None else scale, out, part, counters, M, N, K,
        x.stride(0), w.stride(0), scale.stride(0), out.stride(0), per_split, GROUP=group,
        HALF=half, BLOCK_N=bn, BLOCK_M=bm, SLICES=slices, SPLIT_K=split,
        HAS_BIAS=bias is not None, INTERPRETED=interpreted, **opts)
    return out


def _launch_int4_tiles(mod, interpreted: bool, x: torch.Tensor, w: torch.Tensor,
                       scale: torch.Tensor, zero: torch.Tensor, bias, group: int, half: int,
                       N: int, config) -> torch.Tensor:
    M, K = x.shape
    bn, bm, warps, stages, *more = config
    n_blocks = triton.cdiv(K, 2 * half)
    per_split = triton.cdiv(n_blocks, more[0] if more else 1)
    split = triton.cdiv(n_blocks, per_split)
    if split == 1:
        out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    else:  # fp32 partial tiles, summed in a fixed order below
        out = torch.empty((split, M, N), dtype=torch.float32, device=x.device)
    opts = {} if interpreted else {"num_warps": warps, "num_stages": stages,
                                   **pdl_args(x.device)}
    mod._int4_mma_tile_kernel[(triton.cdiv(M, bm), triton.cdiv(N, bn), split)](
        x, w, scale, zero, bias if bias is not None else scale, out, M, N, K, x.stride(0),
        w.stride(0), scale.stride(0), out.stride(-2), out.stride(0) if split > 1 else 0,
        per_split, GROUP=group, HALF=half, BLOCK_N=bn, BLOCK_M=bm,
        HAS_BIAS=bias is not None, INTERPRETED=interpreted, SPLIT_K=split, **opts)
    if split == 1:
        return out
    out = out.sum(0)
    return (out if bias is None else out + bias.float()).to(x.dtype)


def _int4_dequantized_matmul(mod, interpreted: bool, x: torch.Tensor, w: torch.Tensor,
                             scale: torch.Tensor, zero, bias, group: int, half: int,
                             N: int) -> torch.Tensor:
    """x @ dequant(W)^T (+ bias) for many rows: W to x's dtype by one kernel, then the
    dense matmul (cuBLAS on a GPU). The weights cross memory 4.5 bytes each instead of
    0.5, which a large M's FLOPs hide."""
    K = x.shape[1]
    dense = torch.empty((N, K), dtype=x.dtype, device=x.device)
    bn = 16 if interpreted else 32
    opts = {} if interpreted else {"num_warps": 4, **pdl_args(x.device)}
    mod._int4_dequant_kernel[(triton.cdiv(N, bn), triton.cdiv(K, 2 * half))](
        w, scale, zero, dense, N, K, w.stride(0), scale.stride(0), dense.stride(0),
        GROUP=group, HALF=half, BLOCK_N=bn, FLOAT_ZERO=_float_zero(zero), **opts)
    return torch.nn.functional.linear(x, dense, bias)


def _launch_gemm(mod, interpreted: bool, x: torch.Tensor, w: torch.Tensor,
                 scale: torch.Tensor, zero, fmt: str, group: int, half: int,
                 N: int) -> torch.Tensor:
    M, K = x.shape
    bm, bn, bk, split, warps, stages = _config(M, N, K, x.device, interpreted)
    if fmt == "int4":
        bk = 2 * half  # one packed block a step
    chunks = triton.cdiv(K, bk)
    k_per_split = triton.cdiv(chunks, split) * bk
    split = triton.cdiv(K, k_per_split)
    partial = torch.empty((split, M, N), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(M, bm), triton.cdiv(N, bn), split)
    opts = {} if interpreted else {"num_warps": warps, "num_stages": stages,
                                   **pdl_args(x.device)}
    mod._wq_gemm_kernel[grid](
        x, w, scale, zero if zero is not None else scale, partial, M, N, K, x.stride(0),
        w.stride(0), scale.stride(0) if fmt == "int4" else 0, partial.stride(0),
        partial.stride(1), k_per_split, FORMAT=_FORMATS[fmt], GROUP=group, BLOCK_M=bm,
        BLOCK_N=bn, BLOCK_K=bk, DOT_FP32=x.dtype == torch.float32 or interpreted,
        FLOAT_ZERO=_float_zero(zero), **opts)
    return partial[0] if split == 1 else partial.sum(0)


# int4 with x in fp32, zero points with fractions or blocks under 32 inputs (not for the
# tensor cores): the split-K GEMM up to 64 rows, dequantize and cuBLAS from 65.
INT4_DENSE_MIN_ROWS = 65


def int4_path(M: int, N: int, K: int, sm_count: int | None):
    """Which kernel takes int4 with M rows of 16-bit x (integer zero points), and its
    configuration: ("sliced", int4_mma_config), ("tiles", (BLOCK_N, BLOCK_M, warps,
    stages[, splits of K])) or ("dense", None): dequantize, then cuBLAS. Up to 16 rows
    the sliced kernel. Up to 64 the tile kernel, except the sliced one at up to 32 rows
    with fewer than 4 outputs per input (its slices of K keep the GPU busy where the tiles
    are few). From 65 to 128 rows with at least as many inputs as outputs (o, down) the
    tile kernel with K split in 4. From 65 to 256 rows the tile kernel where a program per
    [128, 256] tile fills the GPU (gate/up), else dense; above 256, dense (cuBLAS's large
    tiles). From sweeps
    over Llama-3.1-8B's projections on the H200 and H100
    (bench/diagnostics/int4_mma_sweep.py, docs/decisions.md). sm_count None: the
    interpreter's tiny configurations."""
    if sm_count is None:
        return ("sliced", int4_mma_config(M, N, K, True)) if M <= 16 else (
            "tiles", (16, 16, 1, 1))
    wide = N >= 4 * K
    if M <= 16 or (M <= 32 and not wide):
        return "sliced", int4_mma_config(M, N, K)
    if M <= 64:
        return "tiles", (64, triton.next_power_of_2(M), 4, 3) if wide else (32, 64, 4, 4)
    if M <= 128 and K >= N:  # o, down: few tiles along N, so K split in 4 as well
        return "tiles", (64, 128, 4, 3, 4)
    if M <= 256 and triton.cdiv(N, 128) * triton.cdiv(M, 256) >= sm_count:
        return "tiles", (128, 128 if M <= 128 else 256, 8, 3)
    return "dense", None


def _int4_mma_fits(x: torch.Tensor, zero, half: int) -> bool:
    """Whether int4 goes to the tensor-core kernels: 16-bit activations, integer zero
    points, blocks of at least 32 inputs (an MMA's K is 16 or more)."""
    return (x.dtype in (torch.bfloat16, torch.float16) and not _float_zero(zero)
            and half >= 16)


def _launch(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, zero, fmt: str,
            group: int, N: int, bias: torch.Tensor | None) -> torch.Tensor:
    if x.dim() != 2 or not x.is_contiguous():
        x = x.reshape(-1, x.shape[-1]).contiguous()
    mod, interpreted = _kernels_for(x.device)
    w = qweight.view(torch.uint8) if fmt == "fp8" else qweight
    M, K = x.shape
    half = int4_half(group, K) if fmt == "int4" else 0
    if fmt == "int4":
        if _int4_mma_fits(x, zero, half):
            path, config = int4_path(M, N, K, None if interpreted else _sm_count(x.device))
        else:  # fp32 x, fractional zero points, tiny blocks: the kernels below, or dense
            path, config = ("dense" if M >= INT4_DENSE_MIN_ROWS else "gemm"), None
        if path in ("sliced", "tiles"):
            return _launch_int4_mma(mod, interpreted, x, w, scale, zero, bias, group, half,
                                    N, config, tiles=path == "tiles")
        if path == "dense":
            return _int4_dequantized_matmul(mod, interpreted, x, w, scale, zero,
                                            None if bias is None else bias.to(x.dtype),
                                            group, half, N)
    if M == 1:
        return _launch_gemv(mod, interpreted, x, w, scale, zero, bias, fmt, group, half, N,
                            gemv_config(fmt, half, N, K, interpreted))
    y = _launch_gemm(mod, interpreted, x, w, scale, zero, fmt, group, half, N)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def int8_gemm(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
    N, K = qweight.shape
    if x.shape[-1] != K:
        raise ValueError(f"x has {x.shape[-1]} inputs, the weight {K}")
    return _launch(x, qweight, scale, None, "int8", K, N, bias).reshape(*x.shape[:-1], N)


def fp8_weight_gemm(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """Weight-only fp8: qweight float8_e4m3fn [N, K], scale fp32 [N]; x in its own dtype
    (the engine's use: a single token, where the weights' bytes are the whole cost; more
    tokens go W8A8 through fp8_mm.py)."""
    N, K = qweight.shape
    if x.shape[-1] != K:
        raise ValueError(f"x has {x.shape[-1]} inputs, the weight {K}")
    return _launch(x, qweight, scale, None, "fp8", K, N, bias).reshape(*x.shape[:-1], N)


def int4_gemm(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
              zero: torch.Tensor, group_size: int, bias: torch.Tensor | None = None,
              ) -> torch.Tensor:
    N = qweight.shape[0]
    K = x.shape[-1]
    if (qweight.shape[1] != int4_packed_bytes(K, int4_half(group_size, K))
            or scale.shape != (N, triton.cdiv(K, group_size))):
        raise ValueError(f"packed int4 weight {tuple(qweight.shape)} / scales "
                         f"{tuple(scale.shape)} do not fit {K} inputs in groups of {group_size}")
    return _launch(x, qweight, scale, zero, "int4", group_size, N, bias).reshape(
        *x.shape[:-1], N)


def linear_gemv(x: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight^T (+ bias) for a single row x [1, K] and a 16-bit weight [N, K] of x's
    dtype: the GEMV kernel with the weights as they are (batch-1 decode, where cuBLAS's
    GEMM is slower on some shapes: model/layers.py's Linear says which)."""
    N, K = weight.shape
    if x.shape[-1] != K or x.numel() != K:
        raise ValueError(f"linear_gemv takes one row of {K} inputs, got {tuple(x.shape)}")
    if weight.dtype not in (torch.float16, torch.bfloat16) or x.dtype != weight.dtype:
        raise TypeError(f"linear_gemv needs 16-bit weights of x's dtype, got {weight.dtype} "
                        f"and {x.dtype}")
    x = x.reshape(1, K).contiguous()
    mod, interpreted = _kernels_for(x.device)
    out = _launch_gemv(mod, interpreted, x, weight, weight, None, bias, "w16", K, 0, N,
                       gemv_config("w16", 0, N, K, interpreted))
    return out.reshape(*x.shape[:-1], N)


class GemvWeight(NamedTuple):
    """A projection's weights as the batch-1 GEMV kernel reads them (a layer's
    `gemv_weight`), for the kernels that put an epilogue after it."""
    codes: torch.Tensor          # [N, K]: 16-bit weights, int8, or e4m3 viewed as uint8
    scale: torch.Tensor | None   # fp32 [N] for the 8-bit formats
    bias: torch.Tensor | None
    fmt: str                     # "w16", "int8" or "fp8"


_EPILOGUE_DT = {torch.float16: 1, torch.bfloat16: 2}


def _epilogue_launch(x: torch.Tensor, w: GemvWeight, N: int, what: str):
    """(kernel module, leading arguments, launch keywords, programs) of an epilogue GEMV
    over N weight rows, BLOCK_N rows (BLOCK_N / 2 output pairs) a program; x one 16-bit
    row (fp32 would let the compiler contract the rotary's products and sums into FMAs
    that PyTorch does not use)."""
    K = w.codes.shape[1]
    if x.numel() != K or x.dtype not in _EPILOGUE_DT:
        raise ValueError(f"{what} takes one 16-bit row of {K} inputs, got "
                         f"{tuple(x.shape)} {x.dtype}")
    if w.fmt not in ("w16", "int8", "fp8") or w.codes.shape[0] != N:
        raise ValueError(f"{what}: weights {w.fmt} {tuple(w.codes.shape)} do not fit")
    mod, interpreted = _kernels_for(x.device)
    bn, bk, warps, loop_stages = gemv_config(w.fmt, 0, N, K, interpreted)
    opts = {} if interpreted else {"num_warps": warps, "num_stages": 2, **pdl_args(x.device)}
    scale = w.scale if w.scale is not None else w.codes
    keywords = dict(FORMAT=_FORMATS[w.fmt], HAS_BIAS=w.bias is not None,
                    DT=_EPILOGUE_DT[x.dtype], BLOCK_N=bn, BLOCK_K=bk, INTERPRETED=interpreted,
                    LOOP_STAGES=loop_stages, **opts)
    args = (x.reshape(1, K).contiguous(), w.codes, scale,
            w.bias if w.bias is not None else scale)
    return mod, args, keywords, triton.cdiv(N, bn)


def gemv_silu_and_mul(x: torch.Tensor, w: GemvWeight) -> torch.Tensor:
    """silu(gate) * up [1, I] for one row x and the gate/up weights [2 * I, K] (gate's
    rows first): the batch-1 GEMV with SiLU x up as its epilogue, the bytes of the GEMV
    followed by fused.silu_and_mul, one launch."""
    N = w.codes.shape[0]
    if N % 2:
        raise ValueError(f"gate/up weights need an even number of rows, got {N}")
    mod, args, keywords, programs = _epilogue_launch(x, w, N, "gemv_silu_and_mul")
    out = torch.empty((1, N // 2), dtype=x.dtype, device=x.device)
    mod._gemv_silu_kernel[(programs,)](*args, out, N // 2, w.codes.shape[1],
                                       w.codes.stride(0), **keywords)
    return out


def gemv_rotary(x: torch.Tensor, w: GemvWeight, positions: torch.Tensor,
                cos_table: torch.Tensor, sin_table: torch.Tensor, q_size: int, kv_size: int,
                k_cache: torch.Tensor, v_cache: torch.Tensor,
                slot_mapping: torch.Tensor) -> torch.Tensor:
    """The batch-1 q/k/v projection (weights [q_size + 2 * kv_size, K], heads of
    cos_table's width) with the rotary embedding at positions[0] and the K/V store into
    slot slot_mapping[0] of the caches ([num_blocks, block_size, kv heads, head_dim], bf16,
    fp16 or e4m3, any strides) as its epilogue; returns q [1, q_size] rotated. The bytes
    of the GEMV followed by fused.rotary_embedding with the store, one launch."""
    D = cos_table.shape[1]
    N = q_size + 2 * kv_size
    if (D % 2 or q_size % D or kv_size % D or sin_table.shape != cos_table.shape
            or not cos_table.is_contiguous() or not sin_table.is_contiguous()):
        raise ValueError(f"gemv_rotary: q {q_size} / kv {kv_size} are not heads of the "
                         f"tables' {D} (contiguous cos and sin of one shape)")
    if (k_cache.dim() != 4 or v_cache.shape != k_cache.shape
            or tuple(k_cache.shape[2:]) != (kv_size // D, D)):
        raise ValueError(f"gemv_rotary: caches {tuple(k_cache.shape)} / "
                         f"{tuple(v_cache.shape)} are not [num_blocks, block_size, "
                         f"{kv_size // D}, {D}]")
    mod, args, keywords, programs = _epilogue_launch(x, w, N, "gemv_rotary")
    q = torch.empty((1, q_size), dtype=x.dtype, device=x.device)
    mod._gemv_rotary_kernel[(programs,)](
        *args, q, positions, cos_table, sin_table, cos_table.shape[0], slot_mapping,
        k_cache, v_cache, *k_cache.stride(), *v_cache.stride(), N, w.codes.shape[1],
        w.codes.stride(0), q_size, kv_size,
        HALF_D=D // 2, CACHE_BLOCK_SIZE=k_cache.shape[1], **keywords)
    return q


def fp8_quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [M, K], fp32 scale [M, 1]) with each row's absolute maximum at 448: the
    activations of a W8A8 matmul, one scale per token (quantization.py's
    quantize_activations_fp8, in one kernel)."""
    if x.dim() != 2 or x.stride(1) != 1:
        x = x.reshape(-1, x.shape[-1]).contiguous()
    M, K = x.shape
    mod, interpreted = _kernels_for(x.device)
    q = torch.empty((M, K), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((M, 1), dtype=torch.float32, device=x.device)
    # A whole row a block up to 16,384 inputs (128 in the interpreter), so it is read once,
    # not twice (W1 fp8 the same within noise: docs/decisions.md, "Quantization").
    one_pass = 128 if interpreted else 16384
    bk = triton.next_power_of_2(K)
    if bk > one_pass:
        bk = 64 if interpreted else 2048
    opts = {} if interpreted else {"num_warps": 4 if bk <= 4096 else 8, **pdl_args(x.device)}
    mod._fp8_rows_kernel[(M,)](x, q.view(torch.uint8), scale, K, x.stride(0), K,
                               BLOCK_K=bk, INTERPRETED=interpreted, **opts)
    return q, scale
