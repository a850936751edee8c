"""Paged attention over a flat batch of tokens, with the metadata passed in explicitly.

Two backends compute the same function:
  * "torch": a readable reference that gathers each sequence's K/V through its block
    table. It is the CPU path and the oracle for the Triton kernels.
  * "triton": the kernels in csrc_triton, which read and write the block pool in place.

KV cache layout per layer: k_cache, v_cache of shape [num_blocks, block_size, Hkv, D];
token slot = block_id * block_size + offset. Slot -1 marks padding (not stored).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .quantization import FP8, FP8_MAX  # an fp8 KV cache holds e4m3 with a scale of 1


@dataclass
class AttentionMetadata:
    """Where each token goes and what each sequence attends to, for one forward pass.

    Sequence i owns query tokens query_start_loc[i]:query_start_loc[i+1] and, after this
    step's K/V are stored, has seq_lens[i] tokens of context; its query token j sits at
    position seq_lens[i] - qlen + j and attends causally to positions 0..that position.
    """

    slot_mapping: torch.Tensor      # [T] int64, -1 = padding
    query_start_loc: torch.Tensor   # [B+1] int32
    seq_lens: torch.Tensor          # [B] int32
    block_tables: torch.Tensor      # [B, max_blocks] int32
    max_query_len: int
    max_seq_len: int
    # Host-side copies so the reference backend never waits on the device.
    query_start_loc_host: list[int] | None = None
    seq_lens_host: list[int] | None = None
    # int32 zeros, >= num_seqs x num_kv_heads: the Triton decode kernel then combines its
    # KV splits itself instead of in a second kernel (csrc_triton.paged_attention_decode).
    decode_counters: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]


def _triton_attention(triton_ops, q, k_cache, v_cache, meta: AttentionMetadata,
                      scale: float, window: int | None = None,
                      softcap: float | None = None) -> torch.Tensor:
    args = (q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
            scale, meta.max_query_len, meta.max_seq_len)
    extra = dict(window=window or 0, softcap=softcap or 0.0)
    if meta.decode_counters is not None:
        return triton_ops.paged_attention_counted(*args, meta.decode_counters, **extra)
    return triton_ops.paged_attention(*args, **extra)


def store_kv_reference(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    key, value = key[valid], value[valid]
    if k_cache.dtype == FP8:  # scale 1: values past e4m3's range saturate
        key, value = key.clamp(-FP8_MAX, FP8_MAX), value.clamp(-FP8_MAX, FP8_MAX)
    blocks, offsets = slots // k_cache.shape[1], slots % k_cache.shape[1]
    k_cache[blocks, offsets] = key.to(k_cache.dtype)  # (an fp8 V cache is a transposed view)
    v_cache[blocks, offsets] = value.to(v_cache.dtype)


def _attend(qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, mask: torch.Tensor | None,
            scale: float, softcap: float | None) -> torch.Tensor:
    """Attention of [..., H, q, D] queries over [..., H, k, D] keys with a boolean mask
    (True: attend). Soft-capped scores (Gemma 2: cap * tanh(scores / cap)) are computed
    as transformers' eager attention does; the rest through SDPA."""
    if softcap is None:
        return F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)
    scores = torch.matmul(qh, kh.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(qh.dtype)
    return torch.matmul(probs, vh)


def paged_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              meta: AttentionMetadata, scale: float, window: int | None = None,
                              softcap: float | None = None) -> torch.Tensor:
    """q: [T, Hq, D] -> [T, Hq, D], one SDPA call per sequence (one for the whole batch
    when every sequence has a single query token). window: a query at position p sees
    keys p - window + 1 .. p only (their blocks may be freed: entries past the window are
    not read for their values)."""
    num_kv_heads = k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    block_size = k_cache.shape[1]
    qsl = meta.query_start_loc_host or meta.query_start_loc.tolist()
    lens = meta.seq_lens_host or meta.seq_lens.tolist()
    if meta.max_query_len == 1 and len(lens) == q.shape[0] and min(lens) > 0:
        return _decode_attention_reference(q, k_cache, v_cache, meta, lens, scale, window,
                                           softcap)
    out = torch.zeros_like(q)
    for i, seq_len in enumerate(lens):
        start, end = qsl[i], qsl[i + 1]
        qlen = end - start
        if qlen == 0 or seq_len == 0:
            continue
        # Keys from the first one any query of the chunk sees (with a window, the blocks
        # before it may have gone back to the pool).
        first = 0 if window is None else max(0, seq_len - qlen - window + 1)
        first_block = first // block_size
        num_blocks = -(-seq_len // block_size)
        blocks = meta.block_tables[i, first_block:num_blocks].long()
        base = first_block * block_size
        k = k_cache[blocks].flatten(0, 1)[:seq_len - base].to(q.dtype)  # [L, Hkv, D]
        v = v_cache[blocks].flatten(0, 1)[:seq_len - base].to(q.dtype)
        if group > 1:
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
        qh = q[start:end].transpose(0, 1)  # [Hq, qlen, D]
        kh, vh = k.transpose(0, 1), v.transpose(0, 1)
        q_pos = torch.arange(seq_len - qlen, seq_len, device=q.device)
        k_pos = torch.arange(base, seq_len, device=q.device)
        mask = k_pos[None, :] <= q_pos[:, None]
        if window is not None:
            mask &= k_pos[None, :] > q_pos[:, None] - window
        o = _attend(qh, kh, vh, None if qlen == 1 and window is None else mask, scale,
                    softcap)
        out[start:end] = o.transpose(0, 1)
    return out


def _decode_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                meta: AttentionMetadata, lens: list[int], scale: float,
                                window: int | None = None,
                                softcap: float | None = None) -> torch.Tensor:
    """Decode batch: gather every sequence's blocks into one padded [B, L, Hkv, D] and
    mask the padding, so the CPU path makes one SDPA call instead of B."""
    block_size = k_cache.shape[1]
    num_blocks = -(-max(lens) // block_size)
    tables = meta.block_tables[:, :num_blocks].long()
    batch = q.shape[0]
    k = k_cache[tables].flatten(1, 2).to(q.dtype)  # [B, L, Hkv, D]
    v = v_cache[tables].flatten(1, 2).to(q.dtype)
    group = q.shape[1] // k.shape[2]
    if group > 1:
        k = k.repeat_interleave(group, dim=2)
        v = v.repeat_interleave(group, dim=2)
    length = torch.tensor(lens, device=q.device)
    k_pos = torch.arange(k.shape[1], device=q.device)[None, :]
    mask = k_pos < length[:, None]  # [B, L]
    if window is not None:
        mask &= k_pos > length[:, None] - 1 - window
    o = _attend(q[:, :, None, :], k.transpose(1, 2), v.transpose(1, 2),
                mask[:, None, None, :], scale, softcap)  # [B, Hq, 1, D]
    return o.reshape(batch, q.shape[1], q.shape[2])


class PagedAttention(nn.Module):
    """Stores this step's K/V into the paged cache, then attends through block tables.
    window: this layer's sliding window (None: the whole context); softcap: Gemma 2's
    score soft-capping; scale: the softmax scale (default head_dim ** -0.5)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int,
                 backend: str = "torch", *, window: int | None = None,
                 softcap: float | None = None, scale: float | None = None) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5 if scale is None else scale
        self.window = window
        self.softcap = softcap
        self.backend = backend

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        k_cache, v_cache = kv_cache
        if self.backend == "triton":
            from . import triton_ops
            triton_ops.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
            return _triton_attention(triton_ops, q, k_cache, v_cache, meta, self.scale,
                                     self.window, self.softcap)
        store_kv_reference(k, v, k_cache, v_cache, meta.slot_mapping)
        return paged_attention_reference(q, k_cache, v_cache, meta, self.scale, self.window,
                                         self.softcap)

    def attend(self, q: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
               meta: AttentionMetadata) -> torch.Tensor:
        """Attention only, for callers that already stored this step's K/V (the fused
        rotary kernel does)."""
        k_cache, v_cache = kv_cache
        if self.backend == "triton":
            from . import triton_ops
            return _triton_attention(triton_ops, q, k_cache, v_cache, meta, self.scale,
                                     self.window, self.softcap)
        return paged_attention_reference(q, k_cache, v_cache, meta, self.scale, self.window,
                                         self.softcap)
