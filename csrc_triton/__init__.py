"""Triton kernels of minivllm: paged KV-cache writes and paged attention.

Public API
----------
store_kv_cache(key, value, k_cache, v_cache, slot_mapping)
paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                scale, max_query_len, max_seq_len, out=None)
paged_attention_decode(q, k_cache, v_cache, block_tables, seq_lens, scale,
                       max_seq_len, out=None, num_splits=None, counters=None,
                       min_split_tokens=None)
decode_split_plan(q, k_cache, v_cache, block_tables, seq_lens, max_seq_len): the decode
          launch's split count and least tokens a split, from decode_num_splits(num_seqs,
          num_kv_heads, max_seq_len, device, programs_per_sm) and decode_min_split_tokens
int8_gemm, int4_gemm, fp8_weight_gemm, fp8_quantize_rows: weight-only quantized
          matmuls and W8A8's activation quantization (quant_gemm.py)
linear_gemv: a single row against 16-bit weights, the same GEMV kernel (quant_gemm.py)
gemv_silu_and_mul, gemv_rotary: that GEMV with SiLU x up, or the rotary embedding and the
          K/V store, as its epilogue (batch-1 decode; quant_gemm.py)
fp8_scaled_mm: W8A8 fp8 matmul, K split across programs for decode-sized batches
          (fp8_mm.py)
argmax_rows, decode_slots: the greedy argmax and the decode rows' positions and KV slots
          (step_ops.py)

KV cache layout (per layer): ``k_cache``/``v_cache`` of shape
``[num_blocks, block_size, num_kv_heads, head_dim]``; a token's slot is
``block_id * block_size + offset_in_block``.  Block tables are int32
``[num_seqs, max_blocks_per_seq]``; only the entries covering
``seq_lens[i]`` tokens are ever read.

CUDA tensors run the compiled kernels (or interpreted ones if
``TRITON_INTERPRET=1`` was set when this package was first used); CPU
tensors always run the kernels through Triton's interpreter (slow: tests
only).  All launches are free of host syncs and data-dependent grids, so they
can be captured in CUDA graphs (the decode grid depends only on the batch
size, the head counts and ``num_splits`` / ``max_seq_len``).
"""

from __future__ import annotations

import importlib
import os
import sys

import torch

__all__ = [
    "store_kv_cache",
    "paged_attention",
    "paged_attention_decode",
    "decode_num_splits",
    "decode_split_plan",
    "decode_min_split_tokens",
]

_LOG2E = 1.4426950408889634
# At most 16 splits: one program combines the used splits' partials in turn, and at
# batch 1 (8 kv heads) 16 splits took 27.7 us at context 8192 against 33.1 with 64, 18.4
# against 29.4 at 4096 (docs/decisions.md).
_MAX_SPLITS = 16
_MIN_SPLIT_TOKENS = 128
# Splits that only even out the waves take >= 1,024 tokens each, and a split count is the
# fewest that fill the last wave to 90%: an H200's decode layer at batch 64, context 1000,
# e4m3 cache, took 49.2 us unsplit against 54.1 in 3 splits (docs/decisions.md,
# "Decode splits by waves").
_WAVE_SPLIT_TOKENS = 1024
_FULL_WAVE = 0.9

# ----------------------------------------------------------------------------
# kernel module selection (compiled for CUDA, interpreted for CPU)
# ----------------------------------------------------------------------------
_default_mod = None
_interp_mod = None
_sm_count_cache: dict = {}


def _is_interpreted(mod) -> bool:
    return type(mod._store_kv_kernel).__name__ == "InterpretedFunction"


def _default_module():
    global _default_mod
    if _default_mod is None:
        _default_mod = importlib.import_module(__name__ + "._kernels")
    return _default_mod


def _interpreted_module():
    """The kernels built under TRITON_INTERPRET=1 (for CPU tensors)."""
    global _interp_mod
    if _interp_mod is not None:
        return _interp_mod
    name = __name__ + "._kernels"
    if name in sys.modules or os.environ.get("TRITON_INTERPRET", "0") == "1":
        mod = _default_module()
        if _is_interpreted(mod):
            _interp_mod = mod
            return mod
    # Load a second copy of _kernels.py with the interpreter switched on.
    from ._interpret import load_interpreted_copy
    _interp_mod = load_interpreted_copy(os.path.join(os.path.dirname(__file__), "_kernels.py"),
                                        __name__ + "._kernels_interpreted")
    return _interp_mod


def _kernels_for(device: torch.device):
    if device.type == "cpu":
        return _interpreted_module()
    return _default_module()


def _uses_interpreter(device: torch.device) -> bool:
    return device.type == "cpu" or _is_interpreted(_default_module())


def _pdl_args(device: torch.device) -> dict:
    """The PDL keywords of a launch on `device` (see _pdl.py)."""
    from ._pdl import launch_args
    return launch_args(device, _uses_interpreter(device))


def _next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def _sm_count(device) -> int:
    if device is None or torch.device(device).type != "cuda":
        return 4  # small "machine" for CPU/interpreter runs
    dev = torch.device(device)
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    n = _sm_count_cache.get(idx)
    if n is None:
        n = torch.cuda.get_device_properties(idx).multi_processor_count
        _sm_count_cache[idx] = n
    return n


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor):
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"k_cache/v_cache must be [num_blocks, block_size, num_kv_heads, head_dim], "
            f"got {tuple(k_cache.shape)} / {tuple(v_cache.shape)}")


def _dot_fp32(dtype: torch.dtype, interpreted: bool) -> bool:
    # fp32: exact ieee dot.  bf16 under the interpreter: numpy has no bf16,
    # so compute in fp32 there.
    return dtype == torch.float32 or (interpreted and dtype == torch.bfloat16)


# ----------------------------------------------------------------------------
# store_kv_cache
# ----------------------------------------------------------------------------
def _attention_strides(q, out, k_cache, v_cache, block_tables) -> tuple[int, ...]:
    """The stride arguments every attention kernel takes, in its order."""
    return (*q.stride(), *out.stride(), *k_cache.stride(), *v_cache.stride(),
            *block_tables.stride())


def _check_attention_shapes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor):
    """(rows, q heads, head_dim, block_size, kv heads) after checking q against the cache."""
    _check_cache(k_cache, v_cache)
    rows, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_dim = k_cache.shape
    if cache_dim != head_dim:
        raise ValueError(f"head_dim mismatch q {head_dim} vs cache {cache_dim}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads {num_heads} not a multiple of num_kv_heads {num_kv_heads}")
    return rows, num_heads, head_dim, block_size, num_kv_heads


def store_kv_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write key/value ``[T, Hkv, D]`` into the paged cache in place.

    ``slot_mapping`` (int32/int64 ``[T]``) gives each token's slot
    (``block_id * block_size + offset``); slot ``-1`` (any negative) is
    padding and is skipped.  No host syncs: CUDA-graph capturable.
    """
    _check_cache(k_cache, v_cache)
    T, H, D = key.shape
    if value.shape != key.shape:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} differ")
    nb, bs, hc, dc = k_cache.shape
    if (hc, dc) != (H, D):
        raise ValueError(f"cache heads/dim {(hc, dc)} do not match key {(H, D)}")
    if slot_mapping.shape[0] < T:
        raise ValueError("slot_mapping shorter than key")
    if T == 0:
        return
    kern = _kernels_for(key.device)
    block_h = _next_pow2(H)
    block_d = _next_pow2(D)
    num_warps = 4 if block_h * block_d >= 2048 else (2 if block_h * block_d >= 512 else 1)
    kern._store_kv_kernel[(T,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.stride(3),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), v_cache.stride(3),
        NUM_KV_HEADS=H, HEAD_DIM=D, BLOCK_SIZE=bs, BLOCK_H=block_h, BLOCK_D=block_d,
        num_warps=num_warps, **_pdl_args(key.device),
    )


# ----------------------------------------------------------------------------
# decode (flash-decoding)
# ----------------------------------------------------------------------------
def decode_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, device=None,
                      programs_per_sm: int = 2) -> int:
    """Number of KV splits used by the decode path.

    A pure function of Python ints (and the device's SM count), so a CUDA graph captured
    for a batch size and ``max_seq_len`` bound keeps a fixed grid. The grid's
    (sequence, kv head) programs run in waves of ``SMs x programs_per_sm`` (what the
    compiled kernel's registers and shared memory allow); a last wave that is mostly
    empty leaves the GPU idle for a program's time. So: no split once the programs fill
    two waves; else the fewest splits whose last wave is at least 90% full (below one
    wave, splitting fills the GPU: the most splits), with >= 128 tokens per split and at
    most 16 (_MAX_SPLITS). docs/decisions.md, "Decode splits by waves".
    """
    progs = max(1, num_seqs * num_kv_heads)
    slots = _sm_count(device) * max(1, int(programs_per_sm))
    if progs >= 2 * slots or max_seq_len <= _MIN_SPLIT_TOKENS:
        return 1
    most = int(min(-(-int(max_seq_len) // _MIN_SPLIT_TOKENS), _MAX_SPLITS))

    def last_wave_fill(splits: int) -> float:
        n = progs * splits
        return n / (slots * -(-n // slots))

    for splits in range(1, most + 1):
        if last_wave_fill(splits) >= _FULL_WAVE:
            return splits
    return max(range(1, most + 1), key=last_wave_fill)  # the first of equals: fewest


def decode_min_split_tokens(num_seqs: int, num_kv_heads: int, device=None,
                            programs_per_sm: int = 2) -> int:
    """The fewest context tokens a split takes (rounded up to whole tiles by the kernel).
    Below one wave of programs a split pays for short contexts too (it fills the GPU):
    a tile. Above, splits only even out the waves, which does not repay a program's
    fixed cost on a short context, so a sequence shorter than 2 x _WAVE_SPLIT_TOKENS
    uses fewer splits than the grid has."""
    slots = _sm_count(device) * max(1, int(programs_per_sm))
    if max(1, num_seqs * num_kv_heads) < slots:
        return 1
    return _WAVE_SPLIT_TOKENS


_occupancy_cache: dict = {}


def _programs_per_sm(kernel, device_index: int) -> int:
    """How many programs of a compiled (not yet launched) kernel an SM holds at once, from
    its registers, shared memory and warps."""
    kernel._init_handles()  # loads the binary: sets n_regs
    props = torch.cuda.get_device_properties(device_index)
    warps = kernel.metadata.num_warps
    regs_per_warp = -(-kernel.n_regs * 32 // 256) * 256  # allocated in units of 256
    by_regs = getattr(props, "regs_per_multiprocessor", 65536) // (regs_per_warp * warps)
    # each resident program also reserves 1 KB of shared memory for the system
    by_smem = (getattr(props, "shared_memory_per_multiprocessor", 233472)
               // (kernel.metadata.shared + 1024))
    by_threads = getattr(props, "max_threads_per_multi_processor", 2048) // (32 * warps)
    return max(1, min(by_regs, by_smem, by_threads, 32))


def _decode_config(head_dim: int, dtype: torch.dtype, interpreted: bool,
                   cache_dtype: torch.dtype | None = None, latency_bound: bool = False):
    # Tuned on an H200 (triton 3.6): the kernel is bandwidth-bound and not
    # very sensitive; fp32 (FMA dots) needs fewer stages to avoid spills. An e4m3
    # cache is bound by instructions per tile (conversions, softmax), which longer
    # tiles amortize, and by latency, which two stages hide better than three: a layer
    # at batch 64 x context 8192 took 306 us with 128 tokens and 2 stages, 327 with 3.
    # 256 tokens took 275 there but lost W1 (ragged short contexts: 7,924 tok/s against
    # 10,780): docs/decisions.md, "FP8 KV cache".
    if interpreted:
        return dict(BLOCK_N=16, num_warps=4, num_stages=1)
    if cache_dtype == torch.float8_e4m3fn and head_dim <= 128:
        return dict(BLOCK_N=128, num_warps=4, num_stages=2)
    if dtype == torch.float32:
        return dict(BLOCK_N=64 if head_dim <= 128 else 32, num_warps=4, num_stages=2)
    if head_dim <= 64:
        return dict(BLOCK_N=128, num_warps=4, num_stages=3)
    if head_dim <= 128:
        # latency_bound (fewer unsplit programs than SMs: a batch of a few sequences, each
        # split a tile or two): 2 stages. A layer of Llama-3.1-8B's at batch 1 took 5.2 /
        # 5.8 / 6.5 us at 128 / 256 / 384 positions against 6.2 / 6.8 / 7.7 with 3, W2 +1%;
        # at batch 64 x 1000 3 stages stay (66.6 against 77.9 us).
        return dict(BLOCK_N=64, num_warps=4, num_stages=2 if latency_bound else 3)
    return dict(BLOCK_N=32, num_warps=4, num_stages=2)


def paged_attention_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           max_seq_len: int, out: torch.Tensor | None = None,
                           num_splits: int | None = None,
                           counters: torch.Tensor | None = None,
                           min_split_tokens: int | None = None, window: int = 0,
                           softcap: float = 0.0) -> torch.Tensor:
    """Decode attention: one query token per sequence, ``q`` is ``[B, Hq, D]``.
    ``window`` > 0: each sequence attends to its last ``window`` positions only (block-table
    entries before them may be -1: freed); ``softcap`` > 0: scores soft-capped.

    Sequence ``b`` attends to kv positions ``0 .. seq_lens[b]-1``.  Rows with
    ``seq_lens[b] == 0`` (CUDA-graph padding) produce zeros.  The grid is
    ``(B, Hkv, num_splits)``; ``num_splits`` and ``min_split_tokens`` (the fewest
    context tokens a split takes; a sequence with fewer than ``num_splits`` times that
    uses fewer splits) default to ``decode_split_plan``'s (Python ints and the compiled
    kernel only; with ``num_splits`` given, a split takes at least a tile).

    ``counters``: an int32 workspace of at least ``B * Hkv`` zeros (the caller keeps
    it; the kernel leaves it zeroed). With it, the splits are combined by the last
    split program of each (sequence, kv head) instead of a second kernel.
    """
    B, Hq, D, bs, Hkv = _check_attention_shapes(q, k_cache, v_cache)
    if seq_lens.shape[0] != B:
        raise ValueError(f"seq_lens has {seq_lens.shape[0]} rows, q has {B}")
    if out is None:
        out = torch.empty((B, Hq, D), dtype=q.dtype, device=q.device)
    if B == 0:
        return out
    launch = _decode_launch(q, k_cache, v_cache, block_tables, seq_lens, scale, out, counters,
                            window, softcap)
    kern, args, meta = launch
    if window:  # the keys a query reads: the window, from its first tile
        max_seq_len = min(max_seq_len, window + meta["BLOCK_N"])
    if num_splits is None:
        num_splits, min_tokens = _decode_plan(q, k_cache, launch, max_seq_len, counters)
    else:
        min_tokens = 1
    if min_split_tokens is not None:
        min_tokens = min_split_tokens
    num_splits = int(max(1, num_splits))
    fused = counters is not None and num_splits > 1
    if fused and (counters.dtype != torch.int32 or counters.numel() < B * Hkv):
        raise ValueError(f"counters must be int32 with >= {B * Hkv} elements")
    if num_splits > 1:
        part_o = torch.empty((B, Hq, num_splits, D), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((B, Hq, num_splits), dtype=torch.float32, device=q.device)
    else:
        part_o = part_lse = out
    min_tiles = max(1, -(-int(min_tokens) // meta["BLOCK_N"]))  # a split's least tiles
    kern._decode_split_kernel[(B, Hkv, num_splits)](
        *_decode_args(args, part_o, part_lse, counters if fused else part_lse, min_tiles),
        NUM_SPLITS=num_splits, FUSED_REDUCE=fused, **meta)
    if num_splits > 1 and not fused:
        kern._decode_reduce_kernel[(B, Hq)](
            part_o, part_lse, out, seq_lens,
            out.stride(0), out.stride(1), out.stride(2), min_tiles,
            NUM_Q_HEADS=Hq, HEAD_DIM=D, BLOCK_N=meta["BLOCK_N"], BLOCK_D=meta["BLOCK_D"],
            NUM_SPLITS=num_splits, BLOCK_S=_next_pow2(num_splits), WINDOW=meta["WINDOW"],
            num_warps=1 if _uses_interpreter(q.device) else 4, **_pdl_args(q.device),
        )
    return out


def decode_split_plan(q, k_cache, v_cache, block_tables, seq_lens, max_seq_len: int,
                      counters=None) -> tuple[int, int]:
    """(splits, least tokens a split takes) for a decode launch of these arguments: from
    the batch, ``max_seq_len`` and how many programs of the compiled split kernel an SM
    holds (``decode_num_splits``, ``decode_min_split_tokens``)."""
    out = torch.empty_like(q)
    launch = _decode_launch(q, k_cache, v_cache, block_tables, seq_lens, 1.0, out, counters)
    return _decode_plan(q, k_cache, launch, max_seq_len, counters)


def _decode_plan(q, k_cache, launch, max_seq_len: int, counters) -> tuple[int, int]:
    kern, args, meta = launch
    B, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    per_sm = 2  # interpreted (CPU) kernels: a small machine's guess
    if not _uses_interpreter(q.device):
        index = q.device.index if q.device.index is not None else torch.cuda.current_device()
        key = (index, q.dtype, k_cache.dtype, D, Hq // Hkv, k_cache.shape[1],
               counters is not None, meta["num_stages"], meta["WINDOW"], meta["SOFTCAP"])
        per_sm = _occupancy_cache.get(key)
        if per_sm is None:  # compiled once: the split variant (the unsplit one lacks a store)
            part = torch.empty(1, dtype=torch.float32, device=q.device)
            kernel = kern._decode_split_kernel.warmup(
                *_decode_args(args, part, part, part if counters is None else counters, 1),
                grid=(1,), **dict(meta, NUM_SPLITS=2, FUSED_REDUCE=counters is not None))
            per_sm = _occupancy_cache[key] = _programs_per_sm(kernel, index)
    return (decode_num_splits(B, Hkv, max_seq_len, q.device, per_sm),
            decode_min_split_tokens(B, Hkv, q.device, per_sm))


def _decode_launch(q, k_cache, v_cache, block_tables, seq_lens, scale, out, counters,
                   window: int = 0, softcap: float = 0.0):
    """The split kernel's module, leading arguments and compile-time arguments (everything
    but the partials, the counters, the least chunk and the splits)."""
    B, Hq, D, bs, Hkv = _check_attention_shapes(q, k_cache, v_cache)
    gqa = Hq // Hkv
    interpreted = _uses_interpreter(q.device)
    latency_bound = not interpreted and B * Hkv < _sm_count(q.device)
    cfg = _decode_config(D, q.dtype, interpreted, k_cache.dtype, latency_bound)
    block_d = _next_pow2(max(D, 16))
    args = (q, k_cache, v_cache, out, block_tables, seq_lens, float(scale) * _LOG2E,
            _attention_strides(q, out, k_cache, v_cache, block_tables))
    meta = dict(NUM_Q_HEADS=Hq, GQA=gqa, HEAD_DIM=D, BLOCK_SIZE=bs,
                BLOCK_G=max(16, _next_pow2(gqa)), BLOCK_N=cfg["BLOCK_N"], BLOCK_D=block_d,
                DOT_FP32=_dot_fp32(q.dtype, interpreted), num_warps=cfg["num_warps"],
                num_stages=cfg["num_stages"], WINDOW=int(window or 0),
                SOFTCAP=float(softcap or 0.0), **_pdl_args(q.device))
    return _kernels_for(q.device), args, meta


def _decode_args(args: tuple, part_o, part_lse, counters, min_tiles: int) -> tuple:
    q, k_cache, v_cache, out, block_tables, seq_lens, qk_scale, strides = args
    return (q, k_cache, v_cache, out, part_o, part_lse, counters, block_tables, seq_lens,
            qk_scale, *strides, min_tiles)


# ----------------------------------------------------------------------------
# varlen prefill / chunked prefill / mixed
# ----------------------------------------------------------------------------
def _prefill_config(max_query_len: int, max_seq_len: int, gqa: int, head_dim: int,
                    dtype: torch.dtype, interpreted: bool,
                    cache_dtype: torch.dtype | None = None):
    """Tile config for a batch whose longest query is max_query_len tokens and longest
    sequence max_seq_len, query heads in groups of gqa. The packed M extent is
    max_query_len * gqa rows; long_ctx: the kv range is long compared with the queries
    (chunked prefill with a cached prefix); long_query: a query of >= 2048 tokens (a long
    prompt's chunk). Tuned on an H200 (triton 3.6) for bf16 with head_dim 64 / 128
    (bench/attention_tuning.py and the W5/W6 A/B in
    bench/results/2026-12-01-h200-prefill-tiles/): for head_dim 64, tiles of 64 rows and
    heavy tiles first on long queries (W6 +12%); for head_dim 128, 64x64, and on a long
    query with groups of 4 or more (a 64-row tile would hold 16 tokens or fewer) 128 rows:
    32 tokens a K/V tile is loaded for, as 64 rows give groups of 2 (Llama-3.1-8B W5
    +1.2%, W6 +0.7%: docs/decisions.md, "Prefill attention tiles, by head dim")."""
    rows = max_query_len * gqa
    long_ctx = max_seq_len >= 2 * max_query_len
    long_query = max_query_len >= 2048
    small_m = max(16, _next_pow2(rows))
    if interpreted:
        return dict(BLOCK_M=min(32, small_m), BLOCK_N=16, num_warps=4, num_stages=1)
    if dtype == torch.float32:
        return dict(BLOCK_M=min(32, small_m), BLOCK_N=32 if head_dim <= 128 else 16, num_warps=4, num_stages=1)
    if head_dim > 128:
        return dict(BLOCK_M=min(64, small_m), BLOCK_N=32, num_warps=8, num_stages=2)
    if head_dim > 64 and cache_dtype == torch.float8_e4m3fn:
        # e4m3 tiles: one stage and 128 rows, 23-37% faster than the 16-bit cache's tiles on
        # Llama-3.1-8B's prefill shapes (bench/results/2026-12-02-h200-kv-cache-fp8-tiles/)
        return dict(BLOCK_M=min(128, small_m), BLOCK_N=64, num_warps=4, num_stages=1,
                    HEAVY_FIRST=long_query)
    if head_dim > 64 and long_query and gqa >= 4:
        return dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=2)
    if head_dim > 64:
        return dict(BLOCK_M=min(64, small_m), BLOCK_N=64, num_warps=4, num_stages=3)
    if long_ctx:
        return dict(BLOCK_M=min(128, small_m), BLOCK_N=64, num_warps=4, num_stages=4,
                    HEAVY_FIRST=long_query)
    return dict(BLOCK_M=min(64, small_m), BLOCK_N=64, num_warps=4, num_stages=3,
                HEAVY_FIRST=long_query)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, scale: float, max_query_len: int,
                    max_seq_len: int, out: torch.Tensor | None = None,
                    decode_counters: torch.Tensor | None = None,
                    use_tma: bool | None = None, window: int = 0,
                    softcap: float = 0.0) -> torch.Tensor:
    """Ragged causal attention over the paged KV cache (prefill, chunked
    prefill, decode, or a mix of them). ``window`` > 0: a query at position p sees
    positions p - window + 1 .. p only (table entries wholly before may be -1);
    ``softcap`` > 0: scores -> softcap * tanh(scores / softcap).

    Sequence ``i`` owns query rows ``query_start_loc[i]:query_start_loc[i+1]``
    (``qlen`` rows) and has ``seq_lens[i]`` tokens in the cache, these new
    ones included; its query ``j`` sits at position ``seq_lens[i]-qlen+j`` and
    attends to kv positions ``0..seq_lens[i]-qlen+j``.  ``max_query_len`` /
    ``max_seq_len`` are Python-int upper bounds.  Returns ``[T, Hq, D]`` in
    q's dtype.  Rows of ``out`` that belong to no sequence are not written.
    Dispatches to :func:`paged_attention_decode` when ``max_query_len == 1``
    and there is one query row per sequence (``decode_counters`` goes with it, as
    its ``counters``). ``use_tma``: see :func:`_launch_prefill`.
    """
    T, Hq, D, bs, Hkv = _check_attention_shapes(q, k_cache, v_cache)
    num_seqs = seq_lens.shape[0]
    if query_start_loc.shape[0] != num_seqs + 1:
        raise ValueError("query_start_loc must have num_seqs + 1 entries")
    if out is None:
        out = torch.empty((T, Hq, D), dtype=q.dtype, device=q.device)
    if T == 0 or num_seqs == 0 or max_query_len <= 0:
        return out
    if max_query_len == 1 and T == num_seqs:
        return paged_attention_decode(q, k_cache, v_cache, block_tables, seq_lens, scale,
                                      max_seq_len, out=out, counters=decode_counters,
                                      window=window, softcap=softcap)
    interpreted = _uses_interpreter(q.device)
    cfg = _prefill_config(int(max_query_len), int(max_seq_len), Hq // Hkv, D, q.dtype,
                          interpreted, k_cache.dtype)
    _launch_prefill(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, out, cfg,
                    use_tma, window, softcap)
    return out


def _tma_tiles_fit(k_cache: torch.Tensor, v_cache: torch.Tensor, block_n: int) -> bool:
    """Whether the prefill kernel can load its K/V tiles whole through tensor descriptors:
    16-bit caches laid out [blocks, block_size, heads, dim] contiguously (an e4m3 V cache is
    stored transposed), each tile inside one block, head_dim a power of two."""
    bs, D = k_cache.shape[1], k_cache.shape[3]
    return (k_cache.dtype in (torch.bfloat16, torch.float16) and v_cache.dtype == k_cache.dtype
            and k_cache.is_contiguous() and v_cache.is_contiguous()
            and bs % block_n == 0 and D == _next_pow2(D) and D >= 16)


_tma_cache: dict = {}


def _tma_available(device: torch.device) -> bool:
    """Hopper or newer, and a Triton with host-side tensor descriptors."""
    if device.type != "cuda" or _uses_interpreter(device):
        return False
    idx = device.index if device.index is not None else torch.cuda.current_device()
    ok = _tma_cache.get(idx)
    if ok is None:
        try:
            from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
            ok = torch.cuda.get_device_capability(idx)[0] >= 9
        except ImportError:
            ok = False
        _tma_cache[idx] = ok
    return ok


def _launch_prefill(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, out,
                    cfg: dict, use_tma: bool | None = None, window: int = 0,
                    softcap: float = 0.0) -> None:
    """The prefill kernel's launch with an explicit tile config (bench/attention_tuning.py
    sweeps configs through it). use_tma: load K/V tiles through tensor descriptors (None:
    wherever the GPU and the cache allow it; True under the interpreter for tests)."""
    T, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    gqa = Hq // Hkv
    interpreted = _uses_interpreter(q.device)
    kern = _kernels_for(q.device)
    block_d = _next_pow2(max(D, 16))
    fits = _tma_tiles_fit(k_cache, v_cache, cfg["BLOCK_N"])
    if use_tma is None:
        use_tma = fits and _tma_available(q.device)
    elif use_tma and not fits:
        raise ValueError("the cache does not allow whole-tile descriptor loads "
                         f"(dtype {k_cache.dtype}, block_size {k_cache.shape[1]}, "
                         f"BLOCK_N {cfg['BLOCK_N']})")
    descs = {}
    if use_tma:
        from triton.tools.tensor_descriptor import TensorDescriptor
        flat = (k_cache.shape[0] * k_cache.shape[1], Hkv * D)
        descs = dict(k_desc=TensorDescriptor.from_tensor(k_cache.view(flat), [cfg["BLOCK_N"], D]),
                     v_desc=TensorDescriptor.from_tensor(v_cache.view(flat), [cfg["BLOCK_N"], D]),
                     USE_TMA=True)
    # Tiles of the whole batch (every sequence's rows, plus one spare tile per sequence:
    # see _kernels._tile_owner), not cdiv(rows, BLOCK_M) x num_seqs: a mixed step's
    # decode rows and a graph's padding sequences no longer launch empty tiles.
    grid = (T * gqa // cfg["BLOCK_M"] + num_seqs, Hkv)
    kern._prefill_kernel[grid](
        q, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc,
        float(scale) * _LOG2E,
        *_attention_strides(q, out, k_cache, v_cache, block_tables),
        num_seqs,
        GQA=gqa, HEAD_DIM=D, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_D=block_d,
        DOT_FP32=_dot_fp32(q.dtype, interpreted),
        HEAVY_FIRST=cfg.get("HEAVY_FIRST", False),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **descs,
        **_pdl_args(q.device), WINDOW=int(window or 0), SOFTCAP=float(softcap or 0.0),
    )


def _cdiv(a: int, b: int) -> int:
    return -(-int(a) // int(b))


# ----------------------------------------------------------------------------
# fused norm / rotary / SwiGLU kernels (csrc_triton/fused.py), imported on
# first use like _kernels (so TRITON_INTERPRET is read then, not at import)
# ----------------------------------------------------------------------------
_FUSED_EXPORTS = (
    "rms_norm",
    "fused_add_rms_norm",
    "rms_norm_heads",
    "rotary_embedding",
    "silu_and_mul",
)
__all__ += list(_FUSED_EXPORTS)


# weight-only quantized GEMMs (csrc_triton/quant_gemm.py), imported the same way
_QUANT_EXPORTS = ("int8_gemm", "int4_gemm", "fp8_weight_gemm", "fp8_quantize_rows",
                  "linear_gemv", "GemvWeight", "gemv_silu_and_mul", "gemv_rotary")
__all__ += list(_QUANT_EXPORTS)

# W8A8 fp8 matmul for decode-sized batches (csrc_triton/fp8_mm.py)
_FP8_MM_EXPORTS = ("fp8_scaled_mm",)
__all__ += list(_FP8_MM_EXPORTS)

# the decode step's ends: its positions and slots, the greedy argmax (csrc_triton/step_ops.py)
_STEP_EXPORTS = ("argmax_rows", "decode_slots")
__all__ += list(_STEP_EXPORTS)

# mixtures of experts: grouped GEMMs over tokens sorted by expert (csrc_triton/moe.py)
_MOE_EXPORTS = ("fused_moe", "route_experts", "align_by_expert")
__all__ += list(_MOE_EXPORTS)


def __getattr__(name):
    if name in _FUSED_EXPORTS:
        fused = importlib.import_module(__name__ + ".fused")
        return getattr(fused, name)
    if name in _QUANT_EXPORTS:
        return getattr(importlib.import_module(__name__ + ".quant_gemm"), name)
    if name in _FP8_MM_EXPORTS:
        return getattr(importlib.import_module(__name__ + ".fp8_mm"), name)
    if name in _STEP_EXPORTS:
        return getattr(importlib.import_module(__name__ + ".step_ops"), name)
    if name in _MOE_EXPORTS:
        return getattr(importlib.import_module(__name__ + ".moe"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
