"""Mixture-of-experts MLP as two grouped GEMMs over tokens sorted by expert.

Public API (re-exported by ``csrc_triton``)
-------------------------------------------
fused_moe(x, w13, w2, weights, ids, act, tiles=None, w13_scale=None, w2_scale=None,
          w13_zero=None, w2_zero=None)
    sum_j weights[t, j] * down_e(act(gate_e(x_t)) * up_e(x_t)), e = ids[t, j], with
    w13 [E, 2I, H] (gate rows, then up rows) and w2 [E, H, I]; e4m3 or int8 weights take
    their per-output-channel scales ([E, 2I], [E, H] fp32); int4 weights are uint8 in
    int4_layout's packing ([E, N, packed bytes]), with a scale and a zero point per group
    of 128 inputs ([E, N, groups]: fp32, uint8).
route_experts(logits, top_k, renormalize, dtype) -> (weights, ids)
    the router's softmax and top-k in one kernel (minivllm.model.moe.route's numbers)
align_by_expert(ids, num_experts, block_m) -> (sorted_rows, block_expert)
moe_tiles(w13, top_k, rows, device) -> the tiles fused_moe uses at this shape and row count

The T * k (token, slot) rows are sorted by expert, each expert's run padded to a multiple
of BLOCK_M: every row tile then belongs to one expert, and one program multiplies it by
that expert's weights (the expert's tiles are read once per tile of rows, only for the
experts the batch uses). Everything is sized by T, k and E alone, with no host sync, so
the step stays inside a CUDA graph: tiles past the last expert's run find expert -1 and
return at once.

A decode step's few rows fill few tiles: Qwen3-30B-A3B at one token gives 8 experts x 12
column tiles, and the grouped GEMMs took 99 us of the H200 against the 18 us their weights'
bytes need. BLOCK_M = 1 is the rows path for such steps: no sort, a program per (row, column
tile) reading its row's expert's weights directly (GEMV-shaped: narrow column tiles, many
programs), the first GEMM's gate and up columns together and silu(gate) * up in its epilogue.
A row's expert is read once per row, so two rows of one expert read it twice: it pays only
at small row counts, which the measured table decides. Its second GEMM can also add each
token's k rows itself (the w2 tiles' SUM_ROWS), with no sum launched after it, where the
table measured that faster.

Tiles (BLOCK_M shared by both GEMMs, as the rows' alignment is; BLOCK_N, BLOCK_K, warps and
stages per GEMM) come from moe_tiles.json beside this file, measured per GPU, expert shape,
weight type and row count by bench/moe_tuning.py; a shape or GPU it lacks gets a rule.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from csrc_triton._interpret import kernels_for
from csrc_triton.int4_layout import int4_half

INT4_GROUP = 128  # inputs per int4 scale and zero point

__all__ = ["fused_moe", "route_experts", "align_by_expert", "moe_tiles", "pick_tiles",
           "tiles_key", "TILES_FILE"]

TILES_FILE = Path(__file__).with_name("moe_tiles.json")


@triton.jit
def _route_kernel(logits_ptr, stride_l, E, weights_ptr, ids_ptr, TOP_K: tl.constexpr,
                  TOP_K_P2: tl.constexpr, RENORMALIZE: tl.constexpr, E_P2: tl.constexpr):
    """Program token: the router's softmax (fp32), its top-k (ranked by logit, which orders
    as the probabilities do, without their rounding; ties to the least expert) and, if
    RENORMALIZE, the k weights over their sum. Whatever the logits (NaN or infinite in rows
    a step does not use), the k ids are distinct experts: NaN ranks first, as in torch.topk,
    and each pick is among the experts not yet taken."""
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, E_P2)
    logits = tl.load(logits_ptr + t * stride_l + e, mask=e < E,
                     other=float("-inf")).to(tl.float32)
    p = tl.exp(logits - tl.max(logits, 0))
    probs = p / tl.sum(p, 0)
    slot = tl.arange(0, TOP_K_P2)
    weights = tl.zeros((TOP_K_P2,), dtype=tl.float32)
    ids = tl.zeros((TOP_K_P2,), dtype=tl.int64)
    rank = tl.where(logits != logits, float("inf"), logits)
    open_ = e < E  # the experts not yet taken
    for j in tl.static_range(TOP_K):
        top = tl.max(tl.where(open_, rank, float("-inf")), 0)
        best = tl.min(tl.where(open_ & (rank == top), e, E_P2), 0)
        weights = tl.where(slot == j, tl.sum(tl.where(e == best, probs, 0.0), 0), weights)
        ids = tl.where(slot == j, best.to(tl.int64), ids)
        open_ = open_ & (e != best)
    if RENORMALIZE:
        weights = weights / tl.sum(weights, 0)
    keep = slot < TOP_K
    tl.store(weights_ptr + t * TOP_K + slot, weights.to(weights_ptr.dtype.element_ty),
             mask=keep)
    tl.store(ids_ptr + t * TOP_K + slot, ids, mask=keep)


def route_experts(logits: torch.Tensor, top_k: int, renormalize: bool,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """minivllm.model.moe.route in one kernel: (weights [T, k] in dtype, expert ids [T, k]
    int64) of router logits [T, E]. route's five small launches a layer (softmax, top-k,
    sum, division, cast) become one."""
    mod, _ = kernels_for(__name__, logits.device)
    logits = logits.contiguous()
    tokens, experts = logits.shape
    weights = torch.empty(tokens, top_k, dtype=dtype, device=logits.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int64, device=logits.device)
    if tokens:
        mod._route_kernel[(tokens,)](
            logits, logits.stride(0), experts, weights, ids, TOP_K=top_k,
            TOP_K_P2=triton.next_power_of_2(top_k), RENORMALIZE=renormalize,
            E_P2=triton.next_power_of_2(experts), num_warps=1)
    return weights, ids


def align_by_expert(ids: torch.Tensor, num_experts: int,
                    block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """sorted_rows [B * block_m] int32: the flat (token * k + slot) rows grouped by expert,
    each expert's group padded to a multiple of block_m with the sentinel T * k;
    block_expert [B] int32: each tile's expert, -1 past the last. B = cdiv(T * k, block_m)
    + num_experts bounds the tiles whatever the routing."""
    flat = ids.flatten()
    rows = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # bincount, without a host sync
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    starts = ends - padded
    order = torch.argsort(flat, stable=True)
    expert = flat[order]
    rank = torch.arange(rows, device=ids.device) - (counts.cumsum(0) - counts)[expert]
    max_blocks = -(-rows // block_m) + num_experts
    sorted_rows = torch.full((max_blocks * block_m,), rows, dtype=torch.int32,
                             device=ids.device)
    sorted_rows[starts[expert] + rank] = order.to(torch.int32)
    block_start = torch.arange(max_blocks, device=ids.device) * block_m
    block_expert = torch.searchsorted(ends, block_start, right=True)
    block_expert = torch.where(block_start < ends[-1], block_expert, -1).to(torch.int32)
    return sorted_rows, block_expert


@triton.jit
def _tile(sorted_ptr, num_rows, N, TOP_K: tl.constexpr, A_BY_TOKEN: tl.constexpr,
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The program's (token, slot) rows, which of them are real, the row of A each reads
    (the token's with A_BY_TOKEN: the first GEMM reads x; else its own), its columns."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.load(sorted_ptr + offs_m)
    rows64 = rows.to(tl.int64)
    a_rows = rows64 // TOP_K if A_BY_TOKEN else rows64
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return rows64, rows < num_rows, a_rows, offs_n, offs_n < N


@triton.jit
def _dot(a, w, DOT_FP32: tl.constexpr):
    if DOT_FP32:
        out = tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(a, w.to(a.dtype))
    return out


@triton.jit
def _store_tile(acc, out_ptr, weight_ptr, rows64, valid, offs_n, n_ok, stride_om,
                SCALE_BY_WEIGHT: tl.constexpr):
    """out[rows, cols] = the tile (SCALE_BY_WEIGHT: times each row's routing weight)."""
    if SCALE_BY_WEIGHT:
        acc = acc * tl.load(weight_ptr + rows64, mask=valid, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + rows64[:, None] * stride_om + offs_n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])


@triton.jit
def _grouped_gemm_kernel(a_ptr, w_ptr, w_scale_ptr, out_ptr, sorted_ptr, block_expert_ptr,
                         weight_ptr, num_rows, N, K, stride_am, stride_we, stride_wn,
                         stride_om, TOP_K: tl.constexpr, A_BY_TOKEN: tl.constexpr,
                         SCALE_BY_WEIGHT: tl.constexpr, DOT_FP32: tl.constexpr,
                         W_SCALED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr):
    """Program (row tile, column tile): out[rows, cols] = A[rows] @ W[expert].T for the
    tile's expert (_tile, _store_tile). W_SCALED: e4m3 or int8 weights, converted to A's
    type per tile (exact: int8's values are integers of at most 8 bits), the sums times
    their output channel's scale (w_scale [E, N])."""
    expert = tl.load(block_expert_ptr + tl.program_id(0)).to(tl.int64)
    if expert < 0:
        return
    rows64, valid, a_rows, offs_n, n_ok = _tile(sorted_ptr, num_rows, N, TOP_K, A_BY_TOKEN,
                                                BLOCK_M, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    w_base = w_ptr + expert * stride_we
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + offs_k[None, :],
                    mask=valid[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_base + offs_n[None, :] * stride_wn + offs_k[:, None],
                    mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if W_SCALED:
            w = w.to(tl.float32)
        acc += _dot(a, w, DOT_FP32)
    if W_SCALED:
        acc = acc * tl.load(w_scale_ptr + expert * N + offs_n, mask=n_ok, other=0.0)[None, :]
    _store_tile(acc, out_ptr, weight_ptr, rows64, valid, offs_n, n_ok, stride_om,
                SCALE_BY_WEIGHT)


@triton.jit
def _grouped_gemm_int4_kernel(a_ptr, w_ptr, scale_ptr, zero_ptr, out_ptr, sorted_ptr,
                              block_expert_ptr, weight_ptr, num_rows, N, K, stride_am,
                              stride_we, stride_wn, stride_se, stride_sn, stride_om,
                              TOP_K: tl.constexpr, A_BY_TOKEN: tl.constexpr,
                              SCALE_BY_WEIGHT: tl.constexpr, DOT_FP32: tl.constexpr,
                              HALF: tl.constexpr, GROUP: tl.constexpr,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """_grouped_gemm_kernel for int4 weights: each step one packed block of 2 * HALF inputs
    (byte j: input j in the low nibble, HALF + j in the high one), dequantized with its
    group's scale and zero point, then two dots (the block's halves)."""
    expert = tl.load(block_expert_ptr + tl.program_id(0)).to(tl.int64)
    if expert < 0:
        return
    rows64, valid, a_rows, offs_n, n_ok = _tile(sorted_ptr, num_rows, N, TOP_K, A_BY_TOKEN,
                                                BLOCK_M, BLOCK_N)
    offs_h = tl.arange(0, HALF)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    w_base = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn
    s_base = expert * stride_se + offs_n * stride_sn
    for k0 in range(0, K, 2 * HALF):
        g = k0 // GROUP
        scale = tl.load(scale_ptr + s_base + g, mask=n_ok, other=0.0)[None, :]
        zero = tl.load(zero_ptr + s_base + g, mask=n_ok, other=0).to(tl.float32)[None, :]
        b = tl.load(w_base + (k0 // 2 + offs_h)[:, None], mask=n_ok[None, :], other=0)
        for part in tl.static_range(2):
            k = k0 + part * HALF + offs_h
            a = tl.load(a_ptr + a_rows[:, None] * stride_am + k[None, :],
                        mask=valid[:, None] & (k < K)[None, :], other=0.0)
            if part == 1:
                codes = b >> 4
            else:
                codes = b & 0xF
            acc += _dot(a, (codes.to(tl.float32) - zero) * scale, DOT_FP32)
    _store_tile(acc, out_ptr, weight_ptr, rows64, valid, offs_n, n_ok, stride_om,
                SCALE_BY_WEIGHT)


@triton.jit
def _rows_gemv_kernel(a_ptr, w_ptr, w_scale_ptr, out_ptr, ids_ptr, weight_ptr, N, K,
                      stride_am, stride_we, stride_wn, stride_om, TOP_K: tl.constexpr,
                      A_BY_TOKEN: tl.constexpr, SCALE_BY_WEIGHT: tl.constexpr,
                      W_SCALED: tl.constexpr, GATED: tl.constexpr, SUM_ROWS: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      LOOP_STAGES: tl.constexpr):
    """Program (row, column tile) of the rows path (BLOCK_M = 1): out[row, cols] = A[row] @
    W[e].T for the row's expert e = ids[row], in float32. GATED: W's columns n (gate) and
    N + n (up) together, out = silu(gate) * up. W_SCALED: e4m3 or int8 weights, the sums
    times their output channel's scale (w_scale [E, rows of W]). SUM_ROWS > 1 (the second
    GEMM, weighted): a program per (token, column tile) adds its token's SUM_ROWS rows, so
    out is [tokens, N] with no sum after it. As the dense batch-1 GEMVs
    (quant_gemm._gemv_sum): products accumulated element-wise and summed over K once at
    the end (a sum per block cost a cross-lane reduction each step), the weight loads
    pipelined LOOP_STAGES deep through shared memory (1: each block loaded when its step
    starts)."""
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    for j in tl.static_range(SUM_ROWS):
        row = tl.program_id(0).to(tl.int64) * SUM_ROWS + j
        expert = tl.load(ids_ptr + row).to(tl.int64)
        a_row = row // TOP_K if A_BY_TOKEN else row
        w_base = w_ptr + expert * stride_we + offs_n[:, None] * stride_wn
        acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        acc2_up = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in tl.range(0, K, BLOCK_K, num_stages=LOOP_STAGES):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < K
            a = tl.load(a_ptr + a_row * stride_am + offs_k, mask=k_ok,
                        other=0.0).to(tl.float32)
            ok = n_ok[:, None] & k_ok[None, :]
            w = tl.load(w_base + offs_k[None, :], mask=ok, other=0.0).to(tl.float32)
            acc2 += w * a[None, :]
            if GATED:
                u = tl.load(w_base + N * stride_wn + offs_k[None, :], mask=ok,
                            other=0.0).to(tl.float32)
                acc2_up += u * a[None, :]
        acc = tl.sum(acc2, 1)
        acc_up = tl.sum(acc2_up, 1)
        if W_SCALED:
            scales = w_scale_ptr + expert * (2 * N if GATED else N) + offs_n
            acc = acc * tl.load(scales, mask=n_ok, other=0.0)
            if GATED:
                acc_up = acc_up * tl.load(scales + N, mask=n_ok, other=0.0)
        if GATED:
            acc = acc * tl.sigmoid(acc) * acc_up
        if SCALE_BY_WEIGHT:
            acc = acc * tl.load(weight_ptr + row).to(tl.float32)
        total += acc
    tl.store(out_ptr + tl.program_id(0).to(tl.int64) * stride_om + offs_n,
             total.to(out_ptr.dtype.element_ty), mask=n_ok)


def _rows_gemm(mod, a, w, w_scale, out, ids, weights, top_k, by_token: bool, scale: bool,
               gated: bool, tiles: dict, sum_rows: int = 1) -> None:
    """The rows path's launch: out [rows, N] (N = w's rows, or half of them when gated);
    with sum_rows (the second GEMM's top-k), out [tokens, N], each token's rows added."""
    n = w.shape[1] // 2 if gated else w.shape[1]
    scaled = w.dtype in (torch.float8_e4m3fn, torch.int8)
    mod._rows_gemv_kernel[(ids.numel() // sum_rows, triton.cdiv(n, tiles["BLOCK_N"]))](
        a, w, w_scale if scaled else weights, out, ids, weights, n, a.shape[1], a.stride(0),
        w.stride(0), w.stride(1), out.stride(0), TOP_K=top_k, A_BY_TOKEN=by_token,
        SCALE_BY_WEIGHT=scale, W_SCALED=scaled, GATED=gated, SUM_ROWS=sum_rows,
        BLOCK_N=tiles["BLOCK_N"], BLOCK_K=tiles["BLOCK_K"], LOOP_STAGES=tiles["num_stages"],
        num_warps=tiles["num_warps"], num_stages=tiles["num_stages"])


def tiles_key(w13: torch.Tensor, top_k: int) -> str:
    """moe_tiles.json's name for an expert shape: experts, w13's rows (2 x the inner
    width) and inputs, top-k, the weights' type."""
    e, n, k = w13.shape
    kind = {torch.float8_e4m3fn: "fp8", torch.int8: "int8", torch.uint8: "int4"}.get(
        w13.dtype, str(w13.dtype).removeprefix("torch."))
    return f"E{e}-N{n}-K{k}-top{top_k}-{kind}"


@functools.lru_cache(maxsize=None)
def _measured() -> dict:
    """moe_tiles.json: {GPU name: {tiles_key: {rows: tiles}}}."""
    return json.loads(TILES_FILE.read_text()) if TILES_FILE.exists() else {}


def moe_tiles(w13: torch.Tensor, top_k: int, rows: int, device: torch.device) -> dict:
    """{"BLOCK_M": m, "w13": {...}, "w2": {...}} (each GEMM's BLOCK_N, BLOCK_K, num_warps,
    num_stages) for `rows` (token, expert) rows, from this GPU's measured entries for the
    shape (pick_tiles)."""
    if device.type != "cuda":  # the interpreter: the smallest tiles tl.dot takes
        gemm = dict(BLOCK_N=16, BLOCK_K=16, num_warps=4, num_stages=1)
        return {"BLOCK_M": 16, "w13": gemm, "w2": dict(gemm)}
    return _measured_tiles(torch.cuda.get_device_name(device), tiles_key(w13, top_k),
                           w13.shape[1], rows)


@functools.lru_cache(maxsize=None)  # asked by every MoE layer of every step
def _measured_tiles(gpu: str, key: str, n: int, rows: int) -> dict:
    return pick_tiles(_measured().get(gpu, {}).get(key), n, rows)


def pick_tiles(entries: dict | None, n: int, rows: int) -> dict:
    """Of one shape's measured entries {rows: tiles}, those of the least row count at or
    above `rows` (else the largest); without entries, a rule (_rule_tiles)."""
    if entries:
        counts = sorted(int(r) for r in entries)
        at = next((r for r in counts if r >= rows), counts[-1])
        return entries[str(at)]
    return _rule_tiles(n, rows, rows_path=True)


def _rule_tiles(n: int, rows: int, rows_path: bool) -> dict:
    """Tiles for a GPU or shape the table lacks (n: w13's rows). Up to 64 rows the rows
    path, with no sort (where the H100's bf16 search, 2026-12-05-h100-moe-qwen3-30b-a3b,
    chose it at every such count); else, or when the rows path is not wanted (int4), small
    grouped tiles for a decode step's few rows and larger ones past 64 rows."""
    if rows_path and rows <= 64:
        return {"BLOCK_M": 1,
                "w13": dict(BLOCK_N=16, BLOCK_K=512, num_warps=4, num_stages=2),
                "w2": dict(BLOCK_N=32, BLOCK_K=256, num_warps=4, num_stages=2)}
    gemm = dict(BLOCK_N=64 if n >= 64 else 32, BLOCK_K=64, num_warps=4, num_stages=3)
    return {"BLOCK_M": 16 if rows <= 64 else 64, "w13": gemm, "w2": dict(gemm)}


def _gemm(mod, a, w, w_scale, w_zero, out, sorted_rows, block_expert, weights, num_rows,
          top_k, by_token: bool, scale: bool, block_m: int, tiles: dict) -> None:
    e, n = w.shape[:2]
    k = a.shape[1]
    grid = (block_expert.shape[0], triton.cdiv(n, tiles["BLOCK_N"]))
    launch = dict(BLOCK_M=block_m, BLOCK_N=tiles["BLOCK_N"], num_warps=tiles["num_warps"],
                  num_stages=tiles["num_stages"])
    if w_zero is not None:  # int4
        mod._grouped_gemm_int4_kernel[grid](
            a, w, w_scale, w_zero, out, sorted_rows, block_expert, weights, num_rows, n, k,
            a.stride(0), w.stride(0), w.stride(1), w_scale.stride(0), w_scale.stride(1),
            out.stride(0), TOP_K=top_k, A_BY_TOKEN=by_token, SCALE_BY_WEIGHT=scale,
            DOT_FP32=a.dtype == torch.float32, HALF=int4_half(INT4_GROUP, k),
            GROUP=INT4_GROUP, **launch)
        return
    scaled = w.dtype in (torch.float8_e4m3fn, torch.int8)
    mod._grouped_gemm_kernel[grid](
        a, w, w_scale if scaled else weights, out, sorted_rows, block_expert, weights, num_rows,
        n, k, a.stride(0), w.stride(0), w.stride(1), out.stride(0), TOP_K=top_k,
        A_BY_TOKEN=by_token, SCALE_BY_WEIGHT=scale, DOT_FP32=a.dtype == torch.float32,
        W_SCALED=scaled, BLOCK_K=tiles["BLOCK_K"], **launch)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
              ids: torch.Tensor, act, tiles: dict | None = None,
              w13_scale: torch.Tensor | None = None,
              w2_scale: torch.Tensor | None = None, w13_zero: torch.Tensor | None = None,
              w2_zero: torch.Tensor | None = None) -> torch.Tensor:
    """See the module docstring. act: the activation of the gate half (act(gate) * up).
    tiles: moe_tiles' answer, by default; tests and bench/moe_tuning.py give their own."""
    mod, _ = kernels_for(__name__, x.device)
    tokens, hidden = x.shape
    top_k = ids.shape[1]
    rows = tokens * top_k
    tiles = tiles or moe_tiles(w13, top_k, rows, x.device)
    block_m = tiles["BLOCK_M"]
    weights = weights.reshape(-1).contiguous()
    if block_m == 1 and w13_zero is not None:  # the rows path has no int4 kernel
        tiles = _rule_tiles(w13.shape[1], rows, rows_path=False)
        block_m = tiles["BLOCK_M"]
    if block_m == 1:
        return _rows_moe(mod, x.contiguous(), w13, w2, weights, ids, act, tiles, w13_scale,
                         w2_scale)
    sorted_rows, block_expert = align_by_expert(ids, w13.shape[0], block_m)
    gate_up = torch.empty(rows, w13.shape[1], dtype=x.dtype, device=x.device)
    _gemm(mod, x.contiguous(), w13, w13_scale, w13_zero, gate_up, sorted_rows, block_expert,
          weights, rows, top_k, True, False, block_m, tiles["w13"])
    gate, up = gate_up.chunk(2, dim=-1)
    h = (act(gate) * up).contiguous()
    out = torch.empty(rows, w2.shape[1], dtype=x.dtype, device=x.device)
    _gemm(mod, h, w2, w2_scale, w2_zero, out, sorted_rows, block_expert, weights, rows, 1,
          False, True, block_m, tiles["w2"])
    return out.view(tokens, top_k, -1).sum(dim=1)


def _rows_moe(mod, x, w13, w2, weights, ids, act, tiles, w13_scale, w2_scale):
    """fused_moe by the rows path (BLOCK_M = 1): silu's gating in the first GEMM's
    epilogue (another activation: applied between the GEMMs, as the grouped path does);
    with the w2 tiles' SUM_ROWS, each token's k rows added in the second GEMM (a program
    per token and column tile: k times fewer programs, no sum launched after it)."""
    tokens, top_k = ids.shape
    flat_ids = ids.reshape(-1).contiguous()
    rows, inner = flat_ids.numel(), w13.shape[1] // 2
    gated = act is F.silu
    h = torch.empty(rows, inner if gated else 2 * inner, dtype=x.dtype, device=x.device)
    _rows_gemm(mod, x, w13, w13_scale, h, flat_ids, weights, top_k, True, False, gated,
               tiles["w13"])
    if not gated:
        gate, up = h.chunk(2, dim=-1)
        h = (act(gate) * up).contiguous()
    sum_rows = top_k if tiles["w2"].get("SUM_ROWS") else 1  # k rows added in the kernel
    out = torch.empty(rows // sum_rows, w2.shape[1], dtype=x.dtype, device=x.device)
    _rows_gemm(mod, h, w2, w2_scale, out, flat_ids, weights, 1, False, True, False,
               tiles["w2"], sum_rows=sum_rows)
    return out if sum_rows > 1 else out.view(tokens, top_k, -1).sum(dim=1)
