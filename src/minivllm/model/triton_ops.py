"""The Triton kernels registered as PyTorch custom ops.

As custom ops they are opaque to torch.compile: the compiler fuses the model's
elementwise work around them without tracing into the kernels' launch code, and CUDA-graph
capture records the launches as they are.
"""

from __future__ import annotations

import torch

import csrc_triton


@torch.library.custom_op("minivllm::store_kv", mutates_args=("k_cache", "v_cache"))
def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    csrc_triton.store_kv_cache(key, value, k_cache, v_cache, slot_mapping)


@store_kv.register_fake
def _(key, value, k_cache, v_cache, slot_mapping) -> None:
    return None


@torch.library.custom_op("minivllm::paged_attention", mutates_args=())
def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, scale: float, max_query_len: int,
                    max_seq_len: int, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    # The output is always a fresh contiguous tensor, in the real op and in the fake one:
    # empty_like(q) would copy q's strides, and under torch.compile q can be a strided view,
    # so the compiler would read a contiguous result with the wrong strides. Rows of no
    # sequence (a graph's padding) stay unwritten: every later op is row by row, and only
    # real rows are stored in the cache or sampled (zeroing them was 1% of W5's kernels).
    out = q.new_empty(q.shape)
    return csrc_triton.paged_attention(q, k_cache, v_cache, block_tables, seq_lens,
                                       query_start_loc, scale, max_query_len, max_seq_len,
                                       out=out, window=window, softcap=softcap)


@paged_attention.register_fake
def _(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, max_query_len,
      max_seq_len, window=0, softcap=0.0):
    return q.new_empty(q.shape)


# The same with the decode kernel's split counters (the graphed decode step's): a
# separate op, since Inductor's functionalization does not take an optional mutated
# argument, and the counters are mutated (they end zeroed, but are written on the way).
@torch.library.custom_op("minivllm::paged_attention_counted", mutates_args=("decode_counters",))
def paged_attention_counted(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, seq_lens: torch.Tensor,
                            query_start_loc: torch.Tensor, scale: float, max_query_len: int,
                            max_seq_len: int, decode_counters: torch.Tensor, window: int = 0,
                            softcap: float = 0.0) -> torch.Tensor:
    out = q.new_empty(q.shape)  # see paged_attention
    return csrc_triton.paged_attention(q, k_cache, v_cache, block_tables, seq_lens,
                                       query_start_loc, scale, max_query_len, max_seq_len,
                                       out=out, decode_counters=decode_counters,
                                       window=window, softcap=softcap)


@paged_attention_counted.register_fake
def _(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, max_query_len,
      max_seq_len, decode_counters, window=0, softcap=0.0):
    return q.new_empty(q.shape)
