"""Quantized projections on a real GPU (skipped without CUDA): the Triton int8/int4
kernels and the fp8 scaled matmul against the dequantized reference, and the engine's
graphs against its eager steps with each method."""

import json

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.model.layers import RotaryEmbedding
from minivllm.model.quantization import GROUP_SIZE, METHODS, QuantizedLinear
from conftest import (GPU_TEST_CONFIG as CONFIG, assert_gemv_rotary_matches, gemv_formats,
                      q4_1_weight, random_prompts)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("M", [1, 33, 65, 300])
@pytest.mark.parametrize("N,K", [(384, 512), (200, 4160)])
def test_kernels_match_the_reference(dtype, M, N, K):
    torch.manual_seed(0)
    linear = torch.nn.Linear(K, N, bias=True, device="cuda", dtype=dtype)
    x = torch.randn(M, K, device="cuda", dtype=dtype)
    for method in METHODS:
        if method == "fp8" and dtype != torch.bfloat16:
            continue  # fp8 runs the model in bf16
        layer = QuantizedLinear.from_linear(linear, method)
        got, want = layer(x).float(), layer.reference(x).float()
        # bf16: the kernels round the dequantized weight to bf16 before the product.
        tol = {torch.bfloat16: 2e-2, torch.float16: 5e-3}.get(dtype, 1e-4)
        err = (got - want).norm() / want.norm()
        assert err < tol, (method, M, float(err))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M", [1, 3, 8, 9, 16])
@pytest.mark.parametrize("N,K,group", [(384, 4160, 128), (200, 512, 32), (4096, 14336, 128)])
def test_int4_tensor_core_kernel(dtype, M, N, K, group):
    """The tensor-core int4 kernel (inline PTX unpacking the nibbles) against the
    dequantized matmul, at up to 16 rows of x: a short last group, groups of 32, the
    down projection's shape of Llama-3.1-8B (up to 8 rows: K split between 2 programs)."""
    from csrc_triton import quant_gemm
    from minivllm.model.quantization import dequantize_int4, int4_half, quantize_int4

    torch.manual_seed(3)
    w = torch.randn(N, K, device="cuda") * 0.02
    packed, scale, zero = quantize_int4(w, group)
    bias = torch.randn(N, device="cuda")
    x = torch.randn(M, K, device="cuda", dtype=dtype)
    want = x.float() @ dequantize_int4(packed, scale, zero, K, group).t() + bias
    got = quant_gemm._launch_int4_mma(quant_gemm, False, x, packed, scale, zero, bias, group,
                                      int4_half(group, K), N, quant_gemm.int4_mma_config(M, N, K))
    assert got.dtype == dtype
    assert (got.float() - want).norm() / want.norm() < 5e-3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M", [17, 40, 64, 65, 200, 1024, 1100])
@pytest.mark.parametrize("N,K,group", [(384, 4160, 128), (200, 512, 32), (4096, 14336, 128)])
def test_int4_many_rows(dtype, M, N, K, group):
    """int4 with more than 16 rows of x, as the layer routes it (the tile kernel, then
    the dense path of dequantize and cuBLAS), against the dequantized matmul: a short
    last group, groups of 32, Llama-3.1-8B's down projection."""
    import csrc_triton
    from csrc_triton import quant_gemm
    from csrc_triton.int4_layout import int4_half
    from minivllm.model.quantization import dequantize_int4, quantize_int4

    torch.manual_seed(4)
    w = torch.randn(N, K, device="cuda") * 0.02
    packed, scale, zero = quantize_int4(w, group)
    bias = torch.randn(N, device="cuda", dtype=dtype)
    x = torch.randn(M, K, device="cuda", dtype=dtype)
    want = x.float() @ dequantize_int4(packed, scale, zero, K, group).t() + bias.float()
    got = csrc_triton.int4_gemm(x, packed, scale, zero, group, bias)
    assert got.dtype == dtype
    assert (got.float() - want).norm() / want.norm() < 5e-3
    # The tile kernel with K split in 4 (compiled; bench/diagnostics/int4_mma_sweep.py's).
    got = quant_gemm._launch_int4_mma(quant_gemm, False, x, packed, scale, zero, bias, group,
                                      int4_half(group, K), N, (64, 64, 4, 3, 4), tiles=True)
    assert got.dtype == dtype
    assert (got.float() - want).norm() / want.norm() < 5e-3


@pytest.mark.parametrize("M", [1, 5, 300])
def test_int4_own_grid_compiled(M):
    """A Q4_1-grid weight (float zero points, groups of 32) in bf16, through the compiled
    int4 kernels: the grid's own numbers (kept from the bf16 copy), so the product is
    the bf16 matmul's within bf16 rounding."""
    w = q4_1_weight(384, 4096).to("cuda", torch.bfloat16)
    linear = torch.nn.Linear(4096, 384, bias=False, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        linear.weight.copy_(w)
    layer = QuantizedLinear.from_linear(linear, "int4")
    assert layer.group_size == 32 and layer.zero.dtype == torch.float32
    x = torch.randn(M, 4096, device="cuda", dtype=torch.bfloat16)
    got, want = layer(x).float(), (x.float() @ w.float().t())
    assert (got - want).norm() / want.norm() < 1e-2
    assert (got - layer.reference(x).float()).norm() / want.norm() < 1e-2


@pytest.mark.parametrize("N,K", [(4096, 4096), (4096, 14336), (6144, 4096), (200, 4160)])
def test_linear_gemv_compiled(N, K):
    """16-bit weights through the GEMV kernel (batch-1 projections) against cuBLAS, and
    the decoder projection class choosing it for one row."""
    import csrc_triton
    from minivllm.model.layers import Linear

    torch.manual_seed(2)
    linear = Linear(K, N, bias=True, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
    want = torch.nn.functional.linear(x, linear.weight, linear.bias).float()
    got = csrc_triton.linear_gemv(x, linear.weight, linear.bias).float()
    assert (got - want).norm() / want.norm() < 1e-2
    linear.fused_ops = True
    assert torch.equal(linear(x), csrc_triton.linear_gemv(x, linear.weight, linear.bias))
    x2 = torch.randn(2, K, device="cuda", dtype=torch.bfloat16)  # more rows: cuBLAS
    assert torch.equal(linear(x2), torch.nn.functional.linear(x2, linear.weight, linear.bias))


@pytest.mark.parametrize("fmt", ["fp8", "w16"])
@pytest.mark.parametrize("N,K", [(4096, 14336), (6144, 4096)])
def test_gemv_loop_stages_compiled(fmt, N, K):
    """The GEMV's weight loads pipelined through shared memory (LOOP_STAGES 2 to 4, as
    bench/diagnostics/gemv_sweep.py launches them): the same products in the same order,
    so the plain loop's result bit for bit."""
    from csrc_triton import quant_gemm
    from minivllm.model.quantization import quantize_fp8

    torch.manual_seed(5)
    w = torch.randn(N, K, device="cuda") * 0.02
    x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
    if fmt == "fp8":
        q, scale = quantize_fp8(w)
        q = q.view(torch.uint8)
    else:
        q, scale = w.bfloat16(), torch.ones(N, device="cuda")
    config = quant_gemm.gemv_config(fmt, 0, N, K)

    def run(stages):
        return quant_gemm._launch_gemv(quant_gemm, False, x, q, scale, None, None, fmt, K, 0,
                                       N, (*config[:3], stages))

    plain = run(1)
    want = x.float() @ (q.view(torch.float8_e4m3fn).float() * scale[:, None]
                        if fmt == "fp8" else q.float()).t()
    assert (plain.float() - want).norm() / want.norm() < 1e-2
    for stages in (2, 3, 4):
        assert torch.equal(run(stages), plain)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gemv_epilogues_compiled(dtype):
    """The batch-1 GEMV with SiLU x up, or the rotary embedding and the K/V store (bf16 or
    e4m3 cache), as its epilogue, compiled and launched as the engine launches it: the
    bytes of the plain GEMV and the fused kernel after it, at Llama-3.1-8B's shapes, for
    16-bit, fp8 and int8 weights."""
    import csrc_triton

    torch.manual_seed(0)
    K, inter, hq, hkv, d = 4096, 14336, 32, 8, 128
    x = torch.randn(1, K, device="cuda").to(dtype)
    gate_up = torch.nn.Linear(K, 2 * inter, bias=False, device="cuda")
    for fmt, w, plain in gemv_formats(gate_up, dtype):
        got = csrc_triton.gemv_silu_and_mul(x, w)
        assert torch.equal(got, csrc_triton.silu_and_mul(plain(x))), fmt
    rope = RotaryEmbedding(d, 8192, 500000.0, None).cuda()
    qkv = torch.nn.Linear(K, (hq + 2 * hkv) * d, bias=True, device="cuda")
    positions = torch.tensor([5000], device="cuda")
    slots = torch.tensor([77], device="cuda")
    for fmt, w, plain in gemv_formats(qkv, dtype):
        for cache_dtype in (dtype, torch.float8_e4m3fn):
            assert_gemv_rotary_matches(x, w, plain, rope, (hq, hkv), positions, slots, (4, 64),
                                       cache_dtype)


@pytest.mark.parametrize("M,K", [(1, 4096), (300, 4160), (64, 14336), (3, 20000)])
def test_fp8_row_quantization_is_torchs(M, K):
    import csrc_triton
    from minivllm.model.quantization import quantize_activations_fp8

    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16) * 5
    got_q, got_s = csrc_triton.fp8_quantize_rows(x)
    want_q, want_s = quantize_activations_fp8(x)
    assert torch.equal(got_s, want_s)
    assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8))


@pytest.mark.parametrize("M", [2, 8, 24, 33, 64, 100, 256])
@pytest.mark.parametrize("N,K", [(4096, 4096), (512, 14336), (6144, 4096)])
def test_fp8_split_k_matmul_compiled(M, N, K):
    """The split-K W8A8 kernel against an fp32 product of the same e4m3 numbers: within a
    bf16 rounding for every split count (the fp8 MMAs' short accumulator moved into fp32
    every 128 inputs: without that, 1.1% off at 14,336 inputs), as torch._scaled_mm is;
    the same bytes on every call and in a CUDA-graph replay, the split counters back at
    zero; and the routed entry point (kernel or cuBLAS)."""
    import csrc_triton
    from csrc_triton import fp8_mm
    from csrc_triton._split_k import split_counters
    from minivllm.model.quantization import quantize_activations_fp8, quantize_fp8

    torch.manual_seed(5)
    xq, xs = quantize_activations_fp8(torch.randn(M, K, device="cuda") * 2)
    q, s = quantize_fp8(torch.randn(N, K, device="cuda") * 0.02)
    want = (xq.float() * xs) @ (q.float() * s[:, None]).t()
    cublas = torch._scaled_mm(xq, q.t(), scale_a=xs, scale_b=s[None, :],
                              out_dtype=torch.bfloat16).float()
    assert ((cublas - want).abs().max() / want.abs().max()) < 5e-3
    swapped = ([(16, 64, 128, 2, 4, 4, True), (16, 128, 256, 4, 4, 3, True)] if M <= 16 else
               [(32, 64, 128, 2, 4, 6, True), (32, 64, 256, 4, 4, 4, True)] if M <= 32 else [])
    for cfg in [(64, 128, 128, 1, 4, 3), (64, 128, 128, 4, 4, 4), (128, 64, 128, 8, 8, 3),
                (64, 256, 128, 2, 4, 3), *swapped]:
        run = lambda: fp8_mm._launch(fp8_mm, False, xq, xs, q, s, None,  # noqa: E731
                                     torch.bfloat16, cfg)
        got = run()
        assert ((got.float() - want).abs().max() / want.abs().max()) < 5e-3, cfg
        assert torch.equal(run(), got)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            replayed = run()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(replayed, got), cfg
    assert int(split_counters(xq.device).abs().sum()) == 0
    got = csrc_triton.fp8_scaled_mm(xq, xs, q, s)
    assert ((got.float() - want).abs().max() / want.abs().max()) < 5e-3


@pytest.mark.parametrize("method", METHODS)
def test_graphs_match_eager_with_quantization(tmp_path, method):
    """A batch of 8 and a lone prompt (batch-1 decode: the GEMV epilogues) through the CUDA
    graphs, against eager steps."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIG))
    prompts = random_prompts(8, 4096, 3, 100, seed=9)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    dtype = "bfloat16" if method == "fp8" else "float32"
    outs = {}
    for eager in (True, False):
        llm = LLM(str(path), load_format="dummy", dtype=dtype, device="cuda",
                  skip_tokenizer_init=True, max_model_len=256, num_kv_blocks=256,
                  quantization=method, enforce_eager=eager)
        outs[eager] = [o.outputs[0].token_ids for o in llm.generate(prompts, params,
                                                                    use_tqdm=False)]
        outs[eager] += [llm.generate([prompts[1]], params, use_tqdm=False)[0]
                        .outputs[0].token_ids]
        assert llm.engine.scheduler.pool.all_free()
        del llm
    same = sum(a == b for a, b in zip(outs[True], outs[False]))
    assert same >= (7 if dtype == "bfloat16" else 9), (method, same)


def test_fp8_kv_cache_through_the_graphs(tmp_path):
    """kv_cache_dtype="fp8" through the Triton kernels and CUDA graphs: twice bf16's
    blocks in the same memory, the graphed steps' tokens as the eager steps', and close
    to the bf16 cache's."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIG))
    prompts = random_prompts(8, 4096, 3, 100, seed=9)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    outs, blocks = {}, {}
    for kv, eager in (("auto", False), ("fp8", True), ("fp8", False)):
        llm = LLM(str(path), load_format="dummy", dtype="bfloat16", device="cuda",
                  skip_tokenizer_init=True, max_model_len=256, kv_cache_dtype=kv,
                  gpu_memory_utilization=0.3, enforce_eager=eager)
        blocks[kv] = llm.engine.runner.num_blocks
        outs[kv, eager] = [o.outputs[0].token_ids for o in llm.generate(prompts, params,
                                                                        use_tqdm=False)]
        assert llm.engine.scheduler.pool.all_free()
        del llm
    assert blocks["fp8"] >= 1.9 * blocks["auto"]
    assert sum(a == b for a, b in zip(outs["fp8", True], outs["fp8", False])) >= 6
    assert sum(a[:3] == b[:3] for a, b in zip(outs["fp8", False], outs["auto", False])) >= 5
