"""csrc_triton.small_m_linear (decode-step projections at batch <= 8) against F.linear.

On a machine without CUDA the kernel runs under Triton's interpreter (tiny shapes); the
gpu-marked tests use the Qwen2.5-0.5B projection shapes, compiled."""

import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

import csrc_triton  # noqa: E402

from minivllm.config import small_m_gemv_mode  # noqa: E402
from minivllm.model.layers import SMALL_M_MAX, GatedMLP  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
DEVICE = "cuda" if (torch.cuda.is_available() and not INTERPRET) else "cpu"


def _ref(x, w, b=None, silu_mul=False):
    """fp64 reference of what the kernel computes (the SwiGLU input rounded to x's dtype,
    as silu_and_mul rounds it)."""
    if silu_mul:
        x = csrc_triton.silu_and_mul(x)
    return F.linear(x.double(), w.double(), None if b is None else b.double())


def _check(out, ref, dtype, k):
    # fp32: accumulation order only. 16-bit: the output's rounding (half an ulp), plus
    # the order of k fp32 additions.
    ulp = {torch.float32: 0.0, torch.bfloat16: 2 ** -8, torch.float16: 2 ** -11}[dtype]
    err = (out.double() - ref).abs()
    bound = ulp * ref.abs() + 1e-6 * k ** 0.5 * (1 + ref.abs())
    assert bool((err <= bound + 1e-12).all()), f"max error {err.max().item():.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 2, 5, 8])
@pytest.mark.parametrize("n,k", [(24, 40), (17, 70)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_linear(dtype, m, n, k, bias):
    g = torch.Generator().manual_seed(m * 100 + n + k)
    x = torch.randn(m, k, generator=g).to(dtype).to(DEVICE)
    w = (torch.randn(n, k, generator=g) * 0.2).to(dtype).to(DEVICE)
    b = torch.randn(n, generator=g).to(dtype).to(DEVICE) if bias else None
    out = csrc_triton.small_m_linear(x, w, b)
    assert out.shape == (m, n) and out.dtype == dtype
    _check(out, _ref(x, w, b), dtype, k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 3, 8])
def test_swiglu_input_matches_silu_and_mul_then_linear(dtype, m):
    g = torch.Generator().manual_seed(m)
    k, n = 48, 20
    gate_up = (torch.randn(m, 2 * k, generator=g) * 2).to(dtype).to(DEVICE)
    w = (torch.randn(n, k, generator=g) * 0.2).to(dtype).to(DEVICE)
    out = csrc_triton.small_m_linear(gate_up, w, silu_mul_input=True)
    _check(out, _ref(gate_up, w, silu_mul=True), dtype, k)


def test_strided_input_and_out_buffer():
    x = torch.randn(3, 64).to(DEVICE)[:, ::2]  # non-contiguous rows
    w = torch.randn(10, 32).to(DEVICE)
    out = torch.full((3, 10), float("nan"), device=DEVICE)
    assert csrc_triton.small_m_linear(x, w, out=out) is out
    _check(out, _ref(x, w), torch.float32, 32)


def test_shape_errors():
    w = torch.zeros(4, 8, device=DEVICE)
    with pytest.raises(ValueError):
        csrc_triton.small_m_linear(torch.zeros(2, 7, device=DEVICE), w)
    with pytest.raises(ValueError):
        csrc_triton.small_m_linear(torch.zeros(2, 8, device=DEVICE), w, silu_mul_input=True)
    assert csrc_triton.small_m_linear(torch.zeros(0, 8, device=DEVICE), w).shape == (0, 4)


def test_gated_mlp_uses_it_only_for_few_rows(monkeypatch):
    torch.manual_seed(0)
    mlp = GatedMLP(32, 48).to(DEVICE)
    calls = []
    real = csrc_triton.small_m_linear

    def counting(*a, **kw):
        calls.append(a[0].shape[0])
        return real(*a, **kw)

    monkeypatch.setattr(csrc_triton, "small_m_linear", counting)
    for mode, expected in (("", 0), ("mlp", 1), ("all", 2)):
        mlp.small_m = mode
        calls.clear()
        x = torch.randn(3, 32, device=DEVICE)
        with torch.no_grad():
            ref = GatedMLP.forward(_plain(mlp), x)
            out = mlp(x)
        assert len(calls) == expected
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        calls.clear()
        with torch.no_grad():
            mlp(torch.randn(SMALL_M_MAX + 1, 32, device=DEVICE))
        assert not calls  # larger steps keep cuBLAS


def _plain(mlp):
    plain = GatedMLP(32, 48).to(DEVICE)
    plain.load_state_dict(mlp.state_dict())
    return plain


def test_mode_flag(monkeypatch):
    for value, mode in (("", ""), ("0", ""), ("mlp", "mlp"), ("all", "all"), ("1", "all"),
                        ("all-norm", "all-norm")):
        monkeypatch.setenv("MINIVLLM_SMALL_M_GEMV", value)
        assert small_m_gemv_mode() == mode
    monkeypatch.setenv("MINIVLLM_SMALL_M_GEMV", "sometimes")
    with pytest.raises(ValueError):
        small_m_gemv_mode()


gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET,
                                reason="needs CUDA (compiled kernels)")


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 4, 8])
@pytest.mark.parametrize("n,k,bias,silu", [(1152, 896, True, False), (896, 896, False, False),
                                           (9728, 896, False, False), (896, 4864, False, True)])
def test_gpu_qwen_shapes(dtype, m, n, k, bias, silu):
    torch.manual_seed(m + n + k)
    x = torch.randn(m, 2 * k if silu else k, device="cuda").to(dtype)
    w = (torch.randn(n, k, device="cuda") * 0.05).to(dtype)
    b = torch.randn(n, device="cuda").to(dtype) if bias else None
    out = csrc_triton.small_m_linear(x, w, b, silu_mul_input=silu)
    _check(out, _ref(x, w, b, silu_mul=silu), dtype, k)
    # and it can be captured in a CUDA graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = csrc_triton.small_m_linear(x, w, b, silu_mul_input=silu)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("has_res", [False, True])
def test_norm_linear_matches_add_norm_then_linear(dtype, m, has_res):
    from minivllm.model.layers import RMSNorm

    g = torch.Generator().manual_seed(m + 10 * has_res)
    k, n = 48, 20
    x = torch.randn(m, k, generator=g).to(dtype).to(DEVICE)
    res = torch.randn(m, k, generator=g).to(dtype).to(DEVICE) if has_res else None
    norm = RMSNorm(k, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(k, generator=g) + 0.5)
    norm = norm.to(device=DEVICE, dtype=dtype)
    w = (torch.randn(n, k, generator=g) * 0.2).to(dtype).to(DEVICE)
    b = torch.randn(n, generator=g).to(dtype).to(DEVICE)
    out, new_res = csrc_triton.small_m_norm_linear(x, res, norm.weight, 1e-6, w, b)
    h = x if res is None else res + x
    assert torch.equal(new_res, h)  # the residual add is PyTorch's, bit for bit
    if res is not None:
        assert new_res.data_ptr() not in (x.data_ptr(), res.data_ptr())
    with torch.no_grad():
        _check(out, _ref(norm(h), w, b), dtype, k)


def test_engine_modes_give_the_same_tokens(tiny_model_dirs, monkeypatch):
    """The model with each small-batch mode (fp32 here, kernels interpreted) against the
    plain one: greedy tokens equal, logprobs within fp32 accumulation differences. Decode
    steps of a 3-request batch take the small-batch kernels; prefills (> 8 tokens) don't."""
    from minivllm import LLM, SamplingParams

    monkeypatch.setenv("MINIVLLM_ATTENTION_BACKEND", "triton")
    monkeypatch.setenv("MINIVLLM_FUSED_OPS", "1")
    prompts = [[5, 9, 200, 31, 7, 99, 12, 4, 18, 3, 77], [8, 2, 41], [130, 12, 6, 6, 90]]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1)
    results = {}
    for family in ("qwen2", "qwen3"):  # q/k/v bias; q/k norm
        for mode in ("", "mlp", "all", "all-norm"):
            llm = LLM(str(tiny_model_dirs[family]), skip_tokenizer_init=True,
                      max_model_len=64, max_num_seqs=4, num_kv_blocks=64)
            for module in llm.engine.runner.model.modules():
                if hasattr(module, "small_m"):
                    module.small_m = mode
            outs = llm.generate(prompts, params, use_tqdm=False)
            results[family, mode] = [(o.outputs[0].token_ids, [
                lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
                for o in outs]
        for mode in ("mlp", "all", "all-norm"):
            for (ids, lps), (ref_ids, ref_lps) in zip(results[family, mode],
                                                       results[family, ""]):
                assert ids == ref_ids, (family, mode)
                assert max(abs(a - b) for a, b in zip(lps, ref_lps)) < 1e-4


@gpu
@needs_cuda
@pytest.mark.parametrize("m", [1, 8])
@pytest.mark.parametrize("n,bias", [(1152, True), (9728, False)])
def test_gpu_norm_linear_qwen_shapes(m, n, bias):
    from minivllm.model.layers import RMSNorm

    torch.manual_seed(m + n)
    k = 896
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    res = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    norm = RMSNorm(k, 1e-6).cuda().to(torch.bfloat16)
    w = (torch.randn(n, k, device="cuda") * 0.05).to(torch.bfloat16)
    b = torch.randn(n, device="cuda").to(torch.bfloat16) if bias else None
    out, new_res = csrc_triton.small_m_norm_linear(x, res, norm.weight, 1e-6, w, b)
    assert torch.equal(new_res, res + x)
    with torch.no_grad():
        ref = _ref(norm(res + x), w, b)
    # The normalized inputs may differ from PyTorch's RMSNorm by an ulp here and there
    # (another reduction order, rsqrtf): compare at the scale of the outputs.
    scale = ref.abs().max().item()
    torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=1e-2 * scale)
