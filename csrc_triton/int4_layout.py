"""The packed int4 layout the quantized kernels read (torch only: the CPU reference and
the checkpoint loaders use it without Triton).

A row's inputs come in blocks of 2H; byte j of a block holds input j in its low nibble and
input H + j in its high one, so a kernel reads each half's activations contiguously. A
row is whole blocks, the last one padded with zero codes.
"""

from __future__ import annotations

import torch


def int4_half(group_size: int, in_features: int) -> int:
    """H: 64, or half the group for groups of 32 or 64, so that a block lies in one group
    (group sizes are powers of two, or one group a row); less for rows shorter than a
    block (tests' tiny models), which would be mostly padding."""
    if group_size >= in_features:
        return min(64, 1 << max(0, (in_features - 1).bit_length() - 1))
    if group_size < 2 or group_size & (group_size - 1):
        raise ValueError(f"int4 group sizes must be powers of two (or one group per row), "
                         f"got {group_size}.")
    return min(64, group_size // 2)


def int4_packed_bytes(in_features: int, half: int) -> int:
    """Bytes per row of the packed layout: whole blocks, the last one padded with zeros."""
    return -(-in_features // (2 * half)) * half


def pack_int4(q: torch.Tensor, half: int) -> torch.Tensor:
    """uint8 values 0..15 [out, in] -> bytes [out, int4_packed_bytes(in, half)]: in each
    block of 2 * half inputs, byte j holds input j (low nibble) and input half + j."""
    out_f, in_f = q.shape
    blocks = -(-in_f // (2 * half))
    padded = q.new_zeros(out_f, blocks * 2 * half)
    padded[:, :in_f] = q
    b = padded.view(out_f, blocks, 2, half)
    return (b[:, :, 0] | (b[:, :, 1] << 4)).reshape(out_f, blocks * half)


def unpack_int4(packed: torch.Tensor, in_features: int, half: int) -> torch.Tensor:
    """The inverse of pack_int4: uint8 values 0..15 [out, in_features]."""
    b = packed.view(packed.shape[0], -1, half)
    q = torch.stack([b & 0xF, b >> 4], dim=2).reshape(packed.shape[0], -1)
    return q[:, :in_features]
