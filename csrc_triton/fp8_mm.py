"""W8A8 fp8 matmul for decode-sized batches: y = (xq * xs) @ (w * ws)^T (+ bias).

Public API (re-exported by ``csrc_triton``)
-------------------------------------------
fp8_scaled_mm(xq, xs, w, ws, bias=None, out_dtype=torch.bfloat16) -> y [M, N]
    xq e4m3 [M, K] with per-row scales xs fp32 [M, 1]; w e4m3 [N, K] with per-output
    scales ws fp32 [N]. Rows where fp8_mm_config names a configuration go to the Triton
    kernel below, the rest to torch._scaled_mm (cuBLAS), which is what a prefill's
    thousands of rows want.

Why a kernel of our own: at 2-128 rows (a decode step of several sequences) the weights'
bytes are the cost, and cuBLAS's fp8 GEMM covers an output of 4,096 columns with 32-64
tiles, a quarter to a half of the H200's 132 SMs, so most of the memory bandwidth goes
unused. This kernel splits K as well, so that every SM streams weights. The partial tiles
are summed by the last program of each tile to finish, in a fixed order (deterministic;
_split_k.py), which then applies the scales and writes y.

CPU tensors run the kernel through Triton's interpreter (tests only), as quant_gemm.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from csrc_triton import _sm_count
from csrc_triton._interpret import jit_helpers, kernels_for
from csrc_triton._pdl import launch_args as pdl_args
from csrc_triton._split_k import split_buffers

_pdl = jit_helpers("_pdl")
_split_k = jit_helpers("_split_k")

__all__ = ["fp8_scaled_mm"]


@triton.jit
def _fp8_mm_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr, part_ptr, count_ptr,
                   M, N, K, stride_xm, stride_wn, stride_om, k_per_split,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                   INTERPRETED: tl.constexpr, PDL: tl.constexpr = False,
                   SWAP_AB: tl.constexpr = False):
    """A [BLOCK_M, BLOCK_N] tile of y over program_id(2)'s k_per_split inputs (a multiple
    of BLOCK_K). Hopper's fp8 MMAs add into an accumulator of less than fp32's precision
    (Triton's default on sm_90 never leaves it: 1.1% of the output's range off cuBLAS at
    14,336 inputs); max_num_imprecise_acc moves the sum into a true fp32 accumulator
    every 128 inputs, as cuBLAS does. SWAP_AB computes the tile transposed,
    the weights as the MMA's first operand: Hopper's MMA takes 64 rows there, and a
    decode step's few rows of x, padded to BLOCK_M = 16 or 32, fill its other side.
    Interpreted, the e4m3 bytes come as uint8 and are multiplied in fp32 (exact
    products, as the tensor cores' are)."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    split = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    _pdl.wait_for_previous(PDL)
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    x_at = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    w_at = w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :]
    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(k_lo, k_hi, BLOCK_K):
        if EVEN_K:
            a = tl.load(x_at + k, mask=m_ok[:, None], other=0.0)
            b = tl.load(w_at + k, mask=n_ok[:, None], other=0.0)
        else:
            k_ok = (k + offs_k < K)[None, :]
            a = tl.load(x_at + k, mask=m_ok[:, None] & k_ok, other=0.0)
            b = tl.load(w_at + k, mask=n_ok[:, None] & k_ok, other=0.0)
        if SWAP_AB:
            a, b = b, a
        if INTERPRETED:
            a = a.to(tl.float8e4nv, bitcast=True).to(tl.float32)
            b = b.to(tl.float8e4nv, bitcast=True).to(tl.float32)
            acc = tl.dot(a, tl.trans(b), acc, input_precision="ieee")
        else:  # fp32 sums every 128 inputs: see the docstring
            acc = tl.dot(a, tl.trans(b), acc, max_num_imprecise_acc=128)
    if SWAP_AB:
        acc = tl.trans(acc)
    ok = m_ok[:, None] & n_ok[None, :]
    last = True
    if SPLIT_K > 1:
        acc, last = _split_k.sum_of_partials(
            acc, part_ptr, count_ptr, pid_m * tl.num_programs(0) + pid_n,
            offs_m[:, None] * N + offs_n[None, :], ok, split, M * N, SPLIT_K)
    if last:
        xs = tl.load(xs_ptr + offs_m, mask=m_ok, other=0.0)
        ws = tl.load(ws_ptr + offs_n, mask=n_ok, other=0.0)
        y = acc * xs[:, None] * ws[None, :]
        if HAS_BIAS:  # added in y's dtype, as a separate add after _scaled_mm would
            y = y.to(out_ptr.dtype.element_ty).to(tl.float32)
            y += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :],
                 y.to(out_ptr.dtype.element_ty), mask=ok)


def _kernels_for(device: torch.device):
    return kernels_for(__name__, device)


def fp8_mm_config(M: int, N: int, K: int, sm_count: int | None):
    """(BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages[, SWAP_AB])
    of the Triton kernel for M rows against an [N, K] weight, or None: torch._scaled_mm.
    Up to 32 rows the tile computed transposed (SWAP_AB: 64 weight rows on the MMA's
    64-row side, x's rows padded to 16 or 32), K split until every SM has a program;
    33-64 rows every projection, [64, 64] tiles; 65-128 rows those with no more outputs
    than inputs (o, down), [128, 64] tiles; K split in 2 (in 4 from 8,192 inputs) where
    the tiles are fewer than the SMs. On Llama-3.1-8B's projections on the H200, these
    were the fastest of 33-96 configurations at every row count they take (within 0.9 us
    of it at 24-64 rows), and cuBLAS was within 1 us or faster where they give way
    (bench/diagnostics/fp8_mm_sweep.py, docs/decisions.md).
    sm_count None: the interpreter's tiny tiles (every call takes the kernel)."""
    if sm_count is None:
        return 16, 16, 32, (2 if K > 32 else 1), 1, 1
    if M > 128 or (M > 64 and N > K):
        return None
    if M <= 32:
        bk = 256 if K >= 8192 else 128
        tiles = triton.cdiv(N, 64)
        split = 1 if tiles >= sm_count else 2 if 2 * tiles >= sm_count else 4
        # the stage counts the sweep found fastest at each split (docs/decisions.md)
        stages = 3 if split == 1 else 6 if split == 2 and bk == 128 else 4
        return (16 if M <= 16 else 32), 64, bk, split, 4, stages, True
    bm, bn = (64, 64) if M <= 64 else (128, 64)
    tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
    split = 1 if tiles >= sm_count else 4 if K >= 8192 else 2
    bk = 256 if K >= 8192 and bm == 64 else 128
    stages = 3 if bk == 256 or split == 1 else 4
    return bm, bn, bk, split, 4 if bm == 64 else 8, stages


def _launch(mod, interpreted: bool, xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor,
            ws: torch.Tensor, bias, out_dtype: torch.dtype, config) -> torch.Tensor:
    M, K = xq.shape
    N = w.shape[0]
    bm, bn, bk, split, warps, stages, swap = (*config, False)[:7]
    k_per_split = triton.cdiv(triton.cdiv(K, bk), split) * bk
    split = triton.cdiv(K, k_per_split)
    grid = (triton.cdiv(N, bn), triton.cdiv(M, bm), split)
    out = torch.empty((M, N), dtype=out_dtype, device=xq.device)
    part, counters = (split_buffers(split, M, N, grid[0] * grid[1], xq.device,
                                    "fp8_scaled_mm") if split > 1 else (out, xs))
    if interpreted:  # the interpreter's numpy has no e4m3: bytes, read as e4m3 in the kernel
        xq, w = xq.view(torch.uint8), w.view(torch.uint8)
    opts = {} if interpreted else {"num_warps": warps, "num_stages": stages,
                                   **pdl_args(xq.device)}
    mod._fp8_mm_kernel[grid](
        xq, xs, w, ws, bias if bias is not None else ws, out, part, counters, M, N, K,
        xq.stride(0), w.stride(0), out.stride(0), k_per_split, BLOCK_M=bm, BLOCK_N=bn,
        BLOCK_K=bk, SPLIT_K=split, EVEN_K=K % bk == 0, HAS_BIAS=bias is not None,
        INTERPRETED=interpreted, SWAP_AB=bool(swap), **opts)
    return out


def fp8_scaled_mm(xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, ws: torch.Tensor,
                  bias: torch.Tensor | None = None,
                  out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """[M, N] = (xq * xs) @ (w * ws)^T (+ bias) in out_dtype (see the module docstring).
    torch._scaled_mm's row-wise scaling writes bf16 only: other dtypes are converted from
    it there; the kernel writes them directly."""
    M, K = xq.shape
    N = w.shape[0]
    if w.shape[1] != K:
        raise ValueError(f"xq has {K} inputs, the weight {w.shape[1]}")
    if xq.stride(1) != 1:
        xq = xq.contiguous()
    mod, interpreted = _kernels_for(xq.device)
    config = fp8_mm_config(M, N, K, None if interpreted else _sm_count(xq.device))
    if config is not None:
        return _launch(mod, interpreted, xq, xs, w, ws, bias, out_dtype, config)
    y = torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=ws[None, :],
                         out_dtype=torch.bfloat16).to(out_dtype)
    return y if bias is None else y + bias
