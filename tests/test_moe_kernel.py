"""The fused MoE path (csrc_triton/moe.py) against the reference loop over experts, under
Triton's interpreter on tiny shapes (compiled on a GPU): experts with no token, a row
count that is no multiple of the tile, tiles of one expert spanning several."""

import pytest
import torch
import torch.nn.functional as F

import csrc_triton
from minivllm.model.moe import experts_reference, route

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Every test runs here (interpreted) and in the GPU check's `-m gpu` selection (compiled).
pytestmark = pytest.mark.gpu


def test_align_by_expert_groups_rows_by_expert():
    ids = torch.tensor([[3, 0], [3, 1], [0, 3], [3, 3]], device=DEVICE)  # expert 2 unused
    rows, experts = csrc_triton.align_by_expert(ids, 5, 4)
    flat = ids.flatten().tolist()
    sentinel = len(flat)
    tiles = rows.view(-1, 4).tolist()
    seen = []
    for tile, e in zip(tiles, experts.tolist()):
        real = [r for r in tile if r != sentinel]
        if e < 0:
            assert not real
            continue
        assert real and all(flat[r] == e for r in real)
        seen += real
    assert sorted(seen) == list(range(sentinel))  # every row once
    assert experts.tolist()[:4] == [0, 1, 3, 3] and set(experts.tolist()[4:]) == {-1}


@pytest.mark.parametrize("experts,top_k,renormalize,dtype", [
    (8, 2, True, torch.float32), (60, 4, False, torch.float32), (128, 8, True, torch.float32),
    (128, 8, True, torch.bfloat16), (5, 3, False, torch.bfloat16)])
def test_route_experts_matches_route(experts, top_k, renormalize, dtype):
    """The one-kernel router against route (softmax in fp32, top-k, renormalized): the same
    experts in the same order, the same weights to rounding; bf16 logits as a bf16 model's
    router gives them. The logits are distinct multiples of 1/16 (exact in bf16): on a tie
    torch.topk's order is unspecified, the kernel's the least expert first."""
    g = torch.Generator().manual_seed(experts + top_k)
    logits = torch.stack([torch.randperm(experts, generator=g) for _ in range(19)])
    logits = (logits.float() / 16 - experts / 32).to(dtype).to(DEVICE)
    want_w, want_ids = route(logits, top_k, renormalize, dtype)
    got_w, got_ids = csrc_triton.route_experts(logits, top_k, renormalize, dtype)
    assert got_ids.dtype == torch.int64 and got_w.dtype == dtype
    assert torch.equal(got_ids, want_ids)
    tol = 1e-6 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(got_w.float(), want_w.float(), rtol=tol, atol=tol)
    tied = csrc_triton.route_experts(torch.zeros_like(logits[:1]), top_k, renormalize, dtype)
    assert tied[1].tolist() == [list(range(top_k))]  # ties: the least expert first
    empty = csrc_triton.route_experts(logits[:0], top_k, renormalize, dtype)
    assert empty[0].shape == (0, top_k) and empty[1].shape == (0, top_k)


def test_route_experts_keeps_ids_in_range_on_nan_and_inf_logits():
    """Rows a step does not use (a graph's padding, a capture's warm-up over an unwritten KV
    cache) can hold NaN or infinite logits: every id must still name an expert, k distinct
    ones, or the experts' kernels read out of bounds (the sort's scatter asserted on the
    H200). NaN ranks first, as torch.topk ranks it; a finite row is untouched."""
    nan, inf = float("nan"), float("inf")
    logits = torch.tensor([[nan] * 6, [-inf] * 6, [inf] * 6, [0.0, nan, 1.0, -inf, inf, 2.0],
                           [0.5, 0.1, 0.3, 0.2, 0.9, 0.4]], device=DEVICE)
    _, ids = csrc_triton.route_experts(logits, 3, True, torch.float32)
    for row in ids.tolist():
        assert all(0 <= e < 6 for e in row) and len(set(row)) == 3, row
    assert ids[3].tolist() == [1, 4, 5] and ids[4].tolist() == [4, 0, 5]


ROWS_TILES = {"BLOCK_M": 1, "w13": dict(BLOCK_N=8, BLOCK_K=16, num_warps=2, num_stages=1),
              "w2": dict(BLOCK_N=16, BLOCK_K=8, num_warps=2, num_stages=1)}


ROWS_SUMMED = {**ROWS_TILES, "w2": {**ROWS_TILES["w2"], "SUM_ROWS": True}}


@pytest.mark.parametrize("tokens,experts,top_k,block_m", [(7, 5, 2, 16), (1, 8, 2, 16),
                                                          (40, 6, 3, 16), (9, 4, 1, 32),
                                                          (1, 8, 2, 1), (7, 5, 3, 1),
                                                          (1, 8, 2, "summed"),
                                                          (7, 5, 3, "summed")])
def test_fused_moe_matches_the_reference(tokens, experts, top_k, block_m):
    """BLOCK_M 1 is the rows path: a program per (row, column tile), no sort; "summed":
    its second GEMM adds each token's k rows itself (a program per token)."""
    g = torch.Generator().manual_seed(tokens * 10 + experts)
    hidden, inter = 32, 24
    x = torch.randn(tokens, hidden, generator=g).to(DEVICE)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g) * 0.2).to(DEVICE)
    w2 = (torch.randn(experts, hidden, inter, generator=g) * 0.2).to(DEVICE)
    logits = torch.randn(tokens, experts, generator=g).to(DEVICE)
    logits[:, -1] = -30.0  # the last expert gets no token
    weights, ids = route(logits, top_k, True, x.dtype)
    want = experts_reference(x, w13, w2, weights, ids, F.silu)
    gemm = dict(BLOCK_N=16, BLOCK_K=16, num_warps=4, num_stages=2)
    tiles = {1: ROWS_TILES, "summed": ROWS_SUMMED}.get(
        block_m, {"BLOCK_M": block_m, "w13": gemm, "w2": gemm})
    got = csrc_triton.fused_moe(x, w13, w2, weights, ids, F.silu, tiles=tiles)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def random_moe(seed: int, tokens: int, experts: int, top_k: int, hidden: int, inter: int):
    """(x, w13, w2, routing weights, expert ids): random tokens, experts and routing."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(DEVICE)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g) * 0.2).to(DEVICE)
    w2 = (torch.randn(experts, hidden, inter, generator=g) * 0.2).to(DEVICE)
    weights, ids = route(torch.randn(tokens, experts, generator=g).to(DEVICE), top_k, True,
                         x.dtype)
    return x, w13, w2, weights, ids


def test_the_rows_path_takes_other_activations_between_its_gemms():
    """silu's gating is the first GEMM's epilogue; another activation (GELU) is applied
    between the GEMMs, on inputs and columns no multiple of the tiles."""
    x, w13, w2, weights, ids = random_moe(5, tokens=3, experts=6, top_k=2, hidden=40,
                                          inter=20)
    for act in (F.silu, F.gelu):
        got = csrc_triton.fused_moe(x, w13, w2, weights, ids, act, tiles=ROWS_TILES)
        want = experts_reference(x, w13, w2, weights, ids, act)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_each_gemm_takes_its_own_tiles():
    """The two GEMMs share BLOCK_M (the rows' alignment) and take their own BLOCK_N and
    BLOCK_K: columns and inputs that are no multiple of either."""
    x, w13, w2, weights, ids = random_moe(3, tokens=11, experts=5, top_k=2, hidden=48,
                                          inter=40)
    tiles = {"BLOCK_M": 16, "w13": dict(BLOCK_N=32, BLOCK_K=16, num_warps=4, num_stages=2),
             "w2": dict(BLOCK_N=16, BLOCK_K=32, num_warps=2, num_stages=3)}
    got = csrc_triton.fused_moe(x, w13, w2, weights, ids, F.silu, tiles=tiles)
    want = experts_reference(x, w13, w2, weights, ids, F.silu)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_measured_tiles_are_looked_up_by_shape_and_rows():
    """moe_tiles: the entry of the least measured row count at or above the step's rows,
    else the largest; a shape without entries (or another weight type) gets the rule."""
    from csrc_triton.moe import pick_tiles, tiles_key
    w13 = torch.empty(8, 64, 32, dtype=torch.bfloat16)
    gemm = dict(BLOCK_N=64, BLOCK_K=128, num_warps=8, num_stages=4)
    table = {tiles_key(w13, 2): {str(r): {"BLOCK_M": m, "w13": gemm, "w2": gemm}
                                 for r, m in ((2, 16), (64, 32), (1024, 128))}}
    assert tiles_key(w13, 2) == "E8-N64-K32-top2-bfloat16"
    entries = table.get(tiles_key(w13, 2))
    pick = [pick_tiles(entries, 64, rows)["BLOCK_M"] for rows in (1, 2, 3, 64, 65, 9000)]
    assert pick == [16, 16, 32, 32, 128, 128]
    rule = [pick_tiles(table.get(tiles_key(w13.to(torch.float8_e4m3fn), 2)), 64, rows)
            for rows in (4, 64, 65)]
    assert [r["BLOCK_M"] for r in rule] == [1, 1, 64]  # the rows path up to 64 rows


@pytest.mark.parametrize("method,rows_path", [("fp8", False), ("int8", False),
                                              ("int4", False), ("fp8", True), ("int8", True),
                                              ("int4", True), ("fp8", "summed")])
def test_quantized_experts_match_their_dequantized_reference(method, rows_path):
    """e4m3 or int8 experts with per-channel scales (the kernel converts per tile and scales
    the sums), int4 with a scale and a zero point per group (the kernel unpacks a block of
    inputs at a time): the reference dequantizes first; the same result up to rounding.
    int4 at 256 inputs: two groups of w13's rows, two packed blocks a row. The rows path
    (BLOCK_M 1) scales its sums the same way; int4 leaves it for the grouped kernel."""
    from minivllm.model.quantization import quantize_fp8, quantize_int4, quantize_int8
    quantize = {"fp8": quantize_fp8, "int8": quantize_int8, "int4": quantize_int4}[method]
    g = torch.Generator().manual_seed(4)
    tokens, experts, top_k = 9, 6, 2
    hidden, inter = (256, 32) if method == "int4" else (32, 16)
    x = torch.randn(tokens, hidden, generator=g).to(DEVICE)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) * 0.2
    w2 = torch.randn(experts, hidden, inter, generator=g) * 0.2
    parts = [[t.view(experts, w.shape[1], -1).to(DEVICE) for t in quantize(w.reshape(-1, k))]
             for w, k in ((w13, hidden), (w2, inter))]
    (q13, s13, *z13), (q2, s2, *z2) = parts
    zeros = dict(w13_zero=z13[0], w2_zero=z2[0]) if method == "int4" else {}
    if method != "int4":
        q13, q2 = q13.view(w13.shape), q2.view(w2.shape)
        s13, s2 = s13.view(experts, -1), s2.view(experts, -1)
    weights, ids = route(torch.randn(tokens, experts, generator=g).to(DEVICE), top_k, True,
                         x.dtype)
    want = experts_reference(x, q13, q2, weights, ids, F.silu, s13, s2, **zeros)
    got = csrc_triton.fused_moe(x, q13, q2, weights, ids, F.silu, w13_scale=s13,
                                w2_scale=s2, tiles={True: ROWS_TILES, "summed": ROWS_SUMMED}.get(rows_path),
                                **zeros)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # And close to the full-precision experts (int8 finest, then e4m3, then 4 bits).
    full = experts_reference(x, w13.to(DEVICE), w2.to(DEVICE), weights, ids, F.silu)
    assert (got - full).norm() / full.norm() < {"fp8": 0.08, "int8": 0.02, "int4": 0.2}[method]
