"""The small kernels at the two ends of a decode step.

Public API (re-exported by ``csrc_triton``)
-------------------------------------------
argmax_rows(logits, out=None) -> out
    the first index of each row's maximum, as ``logits.argmax(-1)`` (NaN counts as the
    largest value, as in PyTorch), int64 [rows].
decode_slots(seq_lens, block_tables, block_size, positions, slots)
    each decode row's position (seq_len - 1) and KV-cache slot (-1 for a row of length 0,
    a graph's padding), written into `positions` and `slots` (int64).

At batch 1 a decode step is a chain of ~300 kernels where each boundary costs time. In
PyTorch ops these two ends were ~14 kernels a step (casts, arithmetic, a gather; a chunk
maximum, an argmax, index arithmetic, a copy): here they are three, launched early like
every other Triton kernel (_pdl.py). The argmax runs in two stages, since one program a
row cannot read a 128k vocabulary fast: each of up to 64 chunks of a row finds its first
maximum, then one program a row picks the first chunk holding the row's maximum.

Launches are free of host syncs and their grids depend only on shapes (CUDA-graph safe).
CPU tensors run the kernels through Triton's interpreter (tests only), as in fused.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from csrc_triton._interpret import jit_helpers, kernels_for
from csrc_triton._pdl import launch_args as pdl_args

_pdl = jit_helpers("_pdl")

__all__ = ["argmax_rows", "decode_slots"]

_MAX_CHUNKS = 64


@triton.jit
def _first_max(v1, i1, v2, i2):
    """Of two (value, index) pairs, the larger value; on a tie, the smaller index."""
    take2 = (v2 > v1) | ((v2 == v1) & (i2 < i1))
    return tl.where(take2, v2, v1), tl.where(take2, i2, i1)


@triton.jit
def _chunk_argmax_kernel(x_ptr, val_ptr, idx_ptr, V, stride_x, chunk_len, num_chunks,
                         BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """Program (row, chunk): the first maximum of x[row, chunk * chunk_len ...] and its
    index, to val / idx [row, chunk]. Each lane keeps its own first maximum (a later
    element replaces it only if larger), then the lanes are reduced by _first_max."""
    _pdl.wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    lanes = tl.arange(0, BLOCK)
    best = tl.full((BLOCK,), float("-inf"), dtype=tl.float32)
    where = lanes + chunk * chunk_len
    start = chunk * chunk_len
    for k in range(start, tl.minimum(start + chunk_len, V), BLOCK):
        offs = k + lanes
        x = tl.load(x_ptr + row * stride_x + offs, mask=offs < V,
                    other=float("-inf")).to(tl.float32)
        x = tl.where(x != x, float("inf"), x)  # NaN: the largest, as torch.argmax has it
        take = x > best
        best = tl.where(take, x, best)
        where = tl.where(take, offs, where)
    v, i = tl.reduce((best, where), 0, _first_max)
    tl.store(val_ptr + row * num_chunks + chunk, v)
    tl.store(idx_ptr + row * num_chunks + chunk, i)


@triton.jit
def _combine_argmax_kernel(val_ptr, idx_ptr, out_ptr, num_chunks, BLOCK_C: tl.constexpr,
                           PDL: tl.constexpr = False):
    """Program row: the first chunk holding the row's maximum gives its index."""
    _pdl.wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    ok = c < num_chunks
    v = tl.load(val_ptr + row * num_chunks + c, mask=ok, other=float("-inf"))
    i = tl.load(idx_ptr + row * num_chunks + c, mask=ok, other=2147483647)
    _, first = tl.reduce((v, i), 0, _first_max)
    tl.store(out_ptr + row, first.to(tl.int64))


@triton.jit
def _decode_slots_kernel(lens_ptr, tables_ptr, pos_ptr, slots_ptr, B, stride_t,
                         BLOCK_SIZE: tl.constexpr, BLOCK: tl.constexpr,
                         PDL: tl.constexpr = False):
    """Rows r: position = max(seq_len - 1, 0), slot = its block's id x BLOCK_SIZE + its
    offset, or -1 where seq_len is 0."""
    _pdl.wait_for_previous(PDL)
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = r < B
    n = tl.load(lens_ptr + r, mask=ok, other=0).to(tl.int64)
    pos = tl.maximum(n - 1, 0)
    block = tl.load(tables_ptr + r.to(tl.int64) * stride_t + pos // BLOCK_SIZE, mask=ok,
                    other=0).to(tl.int64)
    slot = tl.where(n > 0, block * BLOCK_SIZE + pos % BLOCK_SIZE, -1)
    tl.store(pos_ptr + r, pos, mask=ok)
    tl.store(slots_ptr + r, slot, mask=ok)


def _kernels_for(device: torch.device):
    """(module, interpreted, PDL argument and launch option) for tensors on `device`."""
    mod, interpreted = kernels_for(__name__, device)
    return mod, interpreted, pdl_args(device, interpreted)


def argmax_rows(logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``logits.argmax(-1)`` of [rows, vocab] logits (any float dtype, rows contiguous),
    into `out` (int64 [rows]) when given."""
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be [rows, vocab] with contiguous rows, got "
                         f"{tuple(logits.shape)} with strides {logits.stride()}")
    rows, vocab = logits.shape
    if out is None:
        out = torch.empty(rows, dtype=torch.long, device=logits.device)
    if rows == 0:
        return out
    mod, interpreted, pdl = _kernels_for(logits.device)
    block = 1024
    chunk_len = triton.cdiv(triton.cdiv(vocab, _MAX_CHUNKS), block) * block
    chunks = triton.cdiv(vocab, chunk_len)
    val = torch.empty(rows, chunks, dtype=torch.float32, device=logits.device)
    idx = torch.empty(rows, chunks, dtype=torch.int32, device=logits.device)
    warps = {} if interpreted else {"num_warps": 4}
    mod._chunk_argmax_kernel[(rows, chunks)](logits, val, idx, vocab, logits.stride(0),
                                             chunk_len, chunks, BLOCK=block, **warps, **pdl)
    mod._combine_argmax_kernel[(rows,)](val, idx, out, chunks,
                                        BLOCK_C=triton.next_power_of_2(chunks),
                                        **({} if interpreted else {"num_warps": 1}), **pdl)
    return out


def decode_slots(seq_lens: torch.Tensor, block_tables: torch.Tensor, block_size: int,
                 positions: torch.Tensor, slots: torch.Tensor) -> None:
    """Each decode row's position and KV-cache slot (see the module's docstring)."""
    B = seq_lens.shape[0]
    if positions.shape[0] < B or slots.shape[0] < B or block_tables.shape[0] < B:
        raise ValueError(f"{B} rows, but positions {tuple(positions.shape)}, slots "
                         f"{tuple(slots.shape)}, block tables {tuple(block_tables.shape)}")
    if block_tables.stride(1) != 1:
        raise ValueError("block_tables must have contiguous rows")
    if B == 0:
        return
    mod, interpreted, pdl = _kernels_for(seq_lens.device)
    block = 64 if interpreted else 256
    mod._decode_slots_kernel[(triton.cdiv(B, block),)](
        seq_lens, block_tables, positions, slots, B, block_tables.stride(0),
        BLOCK_SIZE=block_size, BLOCK=block, **({} if interpreted else {"num_warps": 4}), **pdl)
