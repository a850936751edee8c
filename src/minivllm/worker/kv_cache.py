"""Allocation and sizing of the paged KV cache.

Each layer has its own K and V tensors of shape [num_blocks, block_size, Hkv, D], the
layout the attention kernels read in place (they take every stride as an argument).
An e4m3 V cache is stored transposed, [num_blocks, Hkv, D, block_size] in memory, and
handed out as a view of that shape: a tile of V then has its tokens contiguous, the order
the P x V product wants its operand in. 8-bit tiles cannot be transposed on the way from
shared memory (ldmatrix's transpose is 16-bit only); read byte by byte they made the fp8
decode kernel slower than bf16's (docs/decisions.md, "FP8 KV cache").

Separate tensors rather than views of one big allocation: the compiled decode step
mutates them through a custom op, and mutated graph inputs that alias one another take a
slow and fragile path in torch.compile.
"""

from __future__ import annotations

import torch

from ..config import ModelConfig, cpu_kv_cache_bytes


class KVCache:
    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.layers = [(torch.zeros(shape, dtype=dtype, device=device),
                        value_cache(shape, dtype, device)) for _ in range(cfg.num_layers)]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for pair in self.layers for t in pair)


def value_cache(shape: tuple[int, int, int, int], dtype: torch.dtype,
                device: torch.device) -> torch.Tensor:
    """A zeroed V cache of `shape` [blocks, block_size, Hkv, D]; for e4m3 a view of
    [blocks, Hkv, D, block_size] memory (tokens contiguous, see the module's note)."""
    if dtype != torch.float8_e4m3fn:
        return torch.zeros(shape, dtype=dtype, device=device)
    blocks, block_size, heads, dim = shape
    return torch.zeros((blocks, heads, dim, block_size), dtype=dtype,
                       device=device).permute(0, 3, 1, 2)


def block_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    return cfg.kv_bytes_per_token(dtype) * block_size


def cpu_num_blocks(cfg: ModelConfig, block_size: int, dtype: torch.dtype,
                   max_num_seqs: int, max_model_len: int) -> int:
    """On a CPU: enough for max_num_seqs full-length sequences, capped by a memory budget."""
    per_seq = -(-max_model_len // block_size)
    wanted = max_num_seqs * per_seq
    budget = cpu_kv_cache_bytes() // block_bytes(cfg, block_size, dtype)
    return max(per_seq, min(wanted, budget))


def gpu_num_blocks(cfg: ModelConfig, block_size: int, dtype: torch.dtype,
                   device: torch.device, gpu_memory_utilization: float,
                   peak_bytes_after_profile: int, reserved_bytes: int = 0,
                   reserved_block_bytes: int = 0) -> int:
    """On a GPU: what is left of gpu_memory_utilization x total memory after the weights
    and the activations of a profiling forward pass at the full token budget (and what is
    reserved: a draft model's weights, and its KV per block)."""
    total = torch.cuda.get_device_properties(device).total_memory
    free_for_kv = total * gpu_memory_utilization - peak_bytes_after_profile - reserved_bytes
    return int(free_for_kv // (block_bytes(cfg, block_size, dtype) + reserved_block_bytes))
