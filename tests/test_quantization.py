"""Quantized projections (model/quantization.py): round trips within each format's rounding
bound, the layer against the dequantized matmul, model-level error bounds on tiny models,
and the engine and the server end to end with each method (the CPU's reference path)."""

from __future__ import annotations

import json

import openai
import pytest
import torch
import torch.nn.functional as F

from minivllm import LLM, SamplingParams
from minivllm.model.layers import RotaryEmbedding
from minivllm.model.quantization import (FP8, GROUP_SIZE, METHODS, OWN_GRID_GROUP,
                                         QuantizedLinear, dequantize_int4, int4_half,
                                         int4_packed_bytes, own_int4_grid, pack_int4,
                                         quantize_activations_fp8, quantize_fp8,
                                         quantize_int4, quantize_int8, unpack_int4)
from minivllm.server.testing import ServerThread, make_tiny_chat_model
from conftest import assert_gemv_rotary_matches, gemv_formats, q4_1_weight, random_prompts


def weights(out_f: int, in_f: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_f, in_f, generator=g) * 0.05
    w[0, 3] = 0.9  # an outlier: its row's scale grows, the others' do not
    return w


def test_int8_round_trip_within_half_a_step():
    w = weights(48, 200)
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and scale.shape == (48,)
    assert q.abs().max() <= 127
    err = (q.float() * scale[:, None] - w).abs()
    assert (err <= scale[:, None] / 2 + 1e-7).all()
    assert torch.allclose(scale, w.abs().amax(1) / 127)


@pytest.mark.parametrize("in_f", [256, 200, 77])  # whole groups, a short last group, odd
def test_int4_round_trip_within_half_a_step(in_f):
    w = weights(24, in_f, seed=1)
    packed, scale, zero = quantize_int4(w)
    groups = -(-in_f // GROUP_SIZE)
    half = int4_half(GROUP_SIZE, in_f)
    assert packed.dtype == torch.uint8 and packed.shape == (24, int4_packed_bytes(in_f, half))
    assert scale.shape == zero.shape == (24, groups)
    q = unpack_int4(packed, in_f, half)
    assert q.max() <= 15
    assert torch.equal(pack_int4(q, half), packed)
    deq = dequantize_int4(packed, scale, zero, in_f)
    step = scale.repeat_interleave(GROUP_SIZE, dim=1)[:, :in_f]
    assert ((deq - w).abs() <= step / 2 + 1e-7).all()
    # Each group's range is its own inputs' (the padding of a short last group adds none).
    last = w[:, (groups - 1) * GROUP_SIZE:]
    span = last.amax(1).clamp(min=0) - last.amin(1).clamp(max=0)
    assert torch.allclose(scale[:, -1], span / 15)


def test_int4_keeps_a_weights_own_4_bit_grid():
    """A weight already on a 4-bit grid (a Q4_1 GGUF converted to floats) is stored on
    that grid, groups of 32 with float zero points: the same numbers back, through the
    reference and the kernels; bf16 copies of it too. Other weights get groups of 128."""
    import csrc_triton

    w = q4_1_weight(24, 256)
    packed, scale, zero = own_int4_grid(w)
    assert zero.dtype == torch.float32 and scale.shape == (24, 256 // OWN_GRID_GROUP)
    deq = dequantize_int4(packed, scale, zero, 256, OWN_GRID_GROUP)
    torch.testing.assert_close(deq, w, rtol=0, atol=1e-6)
    assert own_int4_grid(w.bfloat16()) is not None
    assert own_int4_grid(weights(24, 256)) is None
    assert own_int4_grid(w[:, :250]) is None  # not whole groups of 32

    linear = torch.nn.Linear(256, 24, bias=False)
    with torch.no_grad():
        linear.weight.copy_(w)
    layer = QuantizedLinear.from_linear(linear, "int4")
    assert layer.group_size == OWN_GRID_GROUP
    for rows in (1, 5):
        x = torch.randn(rows, 256)
        torch.testing.assert_close(layer.reference(x), x @ w.t(), rtol=1e-5, atol=1e-5)
        got = csrc_triton.int4_gemm(x, layer.qweight, layer.scale, layer.zero,
                                    layer.group_size)
        torch.testing.assert_close(got, x @ w.t(), rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        linear.weight.copy_(weights(24, 256))
    assert QuantizedLinear.from_linear(linear, "int4").group_size == GROUP_SIZE


def test_fp8_round_trip_within_e4m3_precision():
    w = weights(32, 128, seed=2)
    q, scale = quantize_fp8(w)
    assert q.dtype == FP8
    deq = q.float() * scale[:, None]
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 for normal values; tiny ones are
    # subnormal, with an absolute error of at most half the smallest subnormal step.
    bound = torch.maximum(w.abs() * 2 ** -4, scale[:, None] * 2 ** -10)
    assert ((deq - w).abs() <= bound + 1e-9).all()
    assert torch.allclose(deq.abs().amax(1), w.abs().amax(1), rtol=1e-6)


@pytest.mark.parametrize("method", METHODS)
def test_layer_is_the_dequantized_matmul(method):
    torch.manual_seed(3)
    linear = torch.nn.Linear(200, 40, bias=True)
    layer = QuantizedLinear.from_linear(linear, method)
    x = torch.randn(1, 1, 200)  # one token: fp8 keeps the activations as they are
    y = layer(x)
    assert y.shape == (1, 1, 40) and y.dtype == torch.float32
    w = layer.dequantized_weight()
    torch.testing.assert_close(y, F.linear(x, w, linear.bias.detach()), rtol=1e-5, atol=1e-5)
    if method == "fp8":  # a large step rounds the activations to fp8, one scale per token
        from minivllm.model.quantization import quantize_activations_fp8
        big = torch.randn(100, 200)
        xq, xs = quantize_activations_fp8(big)
        torch.testing.assert_close(layer(big), F.linear(xq.float() * xs, w, linear.bias
                                                        .detach()), rtol=1e-5, atol=1e-5)
    # ...and close to the full-precision layer.
    ref = linear(torch.randn(3, 200))
    stored = sum(b.numel() * b.element_size() for b in layer.buffers())
    assert stored < linear.weight.numel() * 4 / (2 if method == "int4" else 1)
    assert torch.isfinite(ref).all()


# Model-level bounds on tiny random models (2 layers, hidden 64): the logits' error
# relative to their norm. Measured: fp8 0.077-0.094, int8 0.015-0.017, int4 0.21-0.27
# (random weights have no structure to spare: real models lose far less, see
# bench/quant_accuracy.py).
BOUNDS = {"fp8": 0.14, "int8": 0.025, "int4": 0.4}


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("method", METHODS)
def test_model_logits_within_bounds(tiny_model_dirs, family, method):
    prompts = random_prompts(3, 256, 8, 20, seed=5)
    kw = dict(skip_tokenizer_init=True, max_model_len=64)

    def logits_of(llm):
        return torch.cat([_prompt_logits(llm.engine.runner, torch.tensor(p)) for p in prompts])

    base = logits_of(LLM(str(tiny_model_dirs[family]), **kw))
    quant = logits_of(LLM(str(tiny_model_dirs[family]), quantization=method, **kw))
    rel = (quant - base).norm() / base.norm()
    assert rel < BOUNDS[method], (method, float(rel))
    assert rel > 0  # it is quantized


def _prompt_logits(runner, ids: torch.Tensor, start: int = 0) -> torch.Tensor:
    """The model's logits at every position of one sequence's new tokens `ids` (positions
    start.., the cache holding the tokens before), through the runner's model and a KV
    cache, as a prefill or decode step computes them."""
    from minivllm.model.attention import AttentionMetadata

    q, n = len(ids), start + len(ids)
    bs = runner.block_size
    blocks = list(range(-(-n // bs)))
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([blocks[p // bs] * bs + p % bs for p in range(start, n)]),
        query_start_loc=torch.tensor([0, q], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32),
        block_tables=torch.tensor([blocks], dtype=torch.int32),
        max_query_len=q, max_seq_len=n, query_start_loc_host=[0, q], seq_lens_host=[n])
    with torch.inference_mode():
        hidden = runner.model(ids, torch.arange(start, n), runner.kv_cache.layers, meta)
        return runner.model.compute_logits(hidden).float()


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_gemv_epilogues_in_the_decoder(tiny_model_dirs, monkeypatch, kv_cache_dtype):
    """A batch-1 decode step of an fp8 bf16 model through the decoder with the GEMV
    epilogues (SiLU x up, rotary + K/V store; kernels interpreted here, so the layers'
    gate is opened for the CPU): the logits and every layer's cache as the step without
    them, within the rounding of the kernels' own sums (the CPU's plain path is the
    dequantized fp32 matmul); both caches, the e4m3 V cache stored transposed."""
    pytest.importorskip("triton")
    monkeypatch.setenv("MINIVLLM_FUSED_OPS", "1")
    llm = LLM(str(tiny_model_dirs["llama"]), skip_tokenizer_init=True, max_model_len=64,
              dtype="bfloat16", quantization="fp8", kv_cache_dtype=kv_cache_dtype)
    runner = llm.engine.runner
    prompt = torch.tensor(random_prompts(1, 256, 9, 10, seed=9)[0])
    _prompt_logits(runner, prompt[:-1])
    plain = _prompt_logits(runner, prompt[-1:], start=len(prompt) - 1)
    plain_caches = [t.float() for pair in runner.kv_cache.layers for t in pair]
    taken = []
    real = QuantizedLinear.gemv_weight

    def on_the_cpu_too(self, x):
        w = real(self, x, any_device=True)
        taken.append(w is not None)
        return w

    monkeypatch.setattr(QuantizedLinear, "gemv_weight", on_the_cpu_too)
    last = len(prompt) - 1  # the new token's slot (blocks in order): written again
    for pair in runner.kv_cache.layers:
        for t in pair:
            t[last // runner.block_size, last % runner.block_size] = 0
    fused = _prompt_logits(runner, prompt[-1:], start=len(prompt) - 1)
    assert sum(taken) == 2 * 2  # q/k/v and gate/up in each of 2 layers
    torch.testing.assert_close(fused, plain, rtol=2e-2, atol=2e-2)
    for got, want in zip((t.float() for pair in runner.kv_cache.layers for t in pair),
                         plain_caches, strict=True):
        torch.testing.assert_close(got, want, rtol=7e-2, atol=2e-2)


@pytest.mark.parametrize("method", METHODS)
def test_engine_end_to_end(tiny_model_dirs, method):
    """Batched generation with each method: every request completes, seeded sampling
    reproduces, the pool is whole, and int8 (the finest) keeps most greedy tokens."""
    prompts = random_prompts(6, 256, 5, 30, seed=6)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    kw = dict(skip_tokenizer_init=True, max_model_len=128, block_size=4)
    llm = LLM(str(tiny_model_dirs["llama"]), quantization=method, **kw)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    assert all(len(t) == 12 for t in got)
    sampled = SamplingParams(temperature=0.8, seed=3, max_tokens=8, ignore_eos=True)
    a = llm.generate(prompts[:2], sampled, use_tqdm=False)
    b = llm.generate(prompts[:2], sampled, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    assert llm.engine.scheduler.pool.all_free()
    if method == "int8":
        want = [o.outputs[0].token_ids for o in LLM(str(tiny_model_dirs["llama"]), **kw)
                .generate(prompts, greedy, use_tqdm=False)]
        same = sum(x == y for g, w in zip(got, want) for x, y in zip(g, w))
        assert same >= 0.75 * 12 * len(prompts)


def test_quantized_model_is_smaller(tiny_model_dirs):
    from minivllm.model.quantization import PROJECTIONS

    def projection_bytes(llm):
        total = 0
        for module in llm.engine.runner.model.modules():
            for name in PROJECTIONS:
                layer = getattr(module, name, None)
                if layer is not None:
                    total += sum(t.numel() * t.element_size() for t in
                                 list(layer.parameters()) + list(layer.buffers()))
        return total

    kw = dict(skip_tokenizer_init=True, max_model_len=64)
    full = projection_bytes(LLM(str(tiny_model_dirs["llama"]), **kw))
    sizes = {m: projection_bytes(LLM(str(tiny_model_dirs["llama"]), quantization=m, **kw))
             for m in METHODS}
    assert sizes["int8"] < full / 3.5 and sizes["fp8"] < full / 3.5  # fp32 -> 8 bits
    assert sizes["int4"] < full / 6


def test_bad_quantization_and_prequantized_checkpoints_are_refused(tiny_model_dirs, tmp_path):
    with pytest.raises(ValueError, match="quantization must be one of"):
        LLM(str(tiny_model_dirs["llama"]), skip_tokenizer_init=True, quantization="int3")
    cfg = json.loads((tiny_model_dirs["llama"] / "config.json").read_text())
    for qc, message in [
            ({"quant_method": "bitsandbytes"}, "quantized \\('bitsandbytes'\\)"),
            ({"quant_method": "fp8", "weight_block_size": [128]}, "two positive integers"),
            ({"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {
                "num_bits": 4, "type": "int", "strategy": "group"}}}}, "other than 8-bit"),
            ({"quant_method": "compressed-tensors", "format": "pack-quantized",
              "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int",
                                                  "strategy": "group", "group_size": 32},
                                      "input_activations": {"num_bits": 8, "type": "int"}}}},
             "without activation quantization"),
            ({"quant_method": "compressed-tensors", "format": "pack-quantized",
              "ignore": ["lm_head", "re:.*mlp.down_proj"],
              "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int",
                                                  "strategy": "group", "group_size": 32}}}},
             "leaves 're:.\\*mlp.down_proj' unquantized"),
            ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "only 4 bits"),
            ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "only 'gemm'")]:
        cfg["quantization_config"] = qc
        (tmp_path / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(ValueError, match=message):
            LLM(str(tmp_path / "config.json"), load_format="dummy", skip_tokenizer_init=True)
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 32}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="quantization must be None or one of \\['awq'\\]"):
        LLM(str(tmp_path / "config.json"), load_format="dummy", skip_tokenizer_init=True,
            quantization="int8")
    with pytest.raises(ValueError, match="has no quantization_config"):
        LLM(str(tiny_model_dirs["llama"]), skip_tokenizer_init=True, quantization="gptq")
    # Dummy weights for a quantized config: random int4 codes (act-order: the inputs in
    # their own order), and it generates.
    for qc in ({"quant_method": "awq", "bits": 4, "group_size": 32},
               {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True}):
        cfg["quantization_config"] = qc
        (tmp_path / "config.json").write_text(json.dumps(cfg))
        llm = LLM(str(tmp_path / "config.json"), load_format="dummy", skip_tokenizer_init=True,
                  max_model_len=64)
        out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True),
                           use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4
        layer = llm.engine.runner.model.model.layers[0].mlp.down_proj
        assert (layer.input_perm is not None) == bool(qc.get("desc_act"))


@pytest.fixture(scope="module")
def tiny_chat_dir(tmp_path_factory):
    return make_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat-q"))


@pytest.mark.parametrize("method", METHODS)
def test_server_with_quantization(tiny_chat_dir, method):
    """A real server with a quantized model answers chat, streamed and whole, with the same
    text; a bad request still gets an OpenAI error."""
    with ServerThread(dict(model=str(tiny_chat_dir), max_model_len=512, num_kv_blocks=256,
                           quantization=method), served_model_names=["q"]) as s:
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="x")
        msgs = [{"role": "user", "content": "Say something."}]
        whole = client.chat.completions.create(model="q", messages=msgs, max_tokens=16,
                                               temperature=0)
        streamed = "".join(
            c.choices[0].delta.content or "" for c in client.chat.completions.create(
                model="q", messages=msgs, max_tokens=16, temperature=0, stream=True)
            if c.choices)
        assert whole.choices[0].message.content == streamed and streamed
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model="q", messages=msgs, max_tokens=-1)


@pytest.mark.parametrize("M,N,K", [(1, 40, 200), (1, 24, 77), (1, 33, 600), (5, 24, 77),
                                   (19, 33, 256)])
def test_triton_kernels_match_the_reference(M, N, K):
    """The GPU kernels (here under Triton's interpreter) against the dequantized matmul:
    int8, fp8 weights and int4 (short last group, odd K), with a
    bias, split K included; at M = 1 int4's GEMV over several steps of K (fp32 x)."""
    import csrc_triton

    torch.manual_seed(7)
    linear = torch.nn.Linear(K, N, bias=True)
    x = torch.randn(M, K)
    for method in ("int8", "int4", "fp8"):
        layer = QuantizedLinear.from_linear(linear, method)
        # (fp8's reference would round 19 rows' activations: the kernel here is weight-only)
        want = F.linear(x, layer.dequantized_weight(), layer.bias)
        if method == "int8":
            got = csrc_triton.int8_gemm(x, layer.qweight, layer.scale, layer.bias)
        elif method == "fp8":
            got = csrc_triton.fp8_weight_gemm(x, layer.qweight, layer.scale, layer.bias)
        else:
            got = csrc_triton.int4_gemm(x, layer.qweight, layer.scale, layer.zero, GROUP_SIZE,
                                        layer.bias)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # int4 in groups of 32, several groups to a tile (and a short last one).
    packed, scale, zero = quantize_int4(linear.weight.detach(), 32)
    want = x @ dequantize_int4(packed, scale, zero, K, 32).t() + linear.bias.detach()
    got = csrc_triton.int4_gemm(x, packed, scale, zero, 32, linear.bias.detach())
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_gemv_loop_stages_change_nothing_but_the_loads():
    """The GEMV with its weight loads pipelined (LOOP_STAGES 2 and 3; interpreted here, so
    only the arithmetic is checked) gives the plain loop's result: 8-bit and 16-bit
    weights over ten steps of K."""
    from csrc_triton import quant_gemm

    torch.manual_seed(12)
    N, K = 12, 600
    mod, interpreted = quant_gemm._kernels_for(torch.device("cpu"))
    w, bias = torch.randn(N, K), torch.randn(N)
    for fmt, x in (("fp8", torch.randn(1, K)), ("w16", torch.randn(1, K).bfloat16())):
        if fmt == "fp8":
            q, scale = quantize_fp8(w)
            q = q.view(torch.uint8)
        else:
            q, scale = w.bfloat16(), torch.ones(N)
        bn, bk, warps, stages = quant_gemm.gemv_config(fmt, 0, N, K, interpreted)
        assert stages == 1 and K > 8 * bk
        plain = quant_gemm._launch_gemv(mod, interpreted, x, q, scale, None, bias, fmt, K,
                                        0, N, (bn, bk, warps, 1))
        for st in (2, 3):
            assert torch.equal(quant_gemm._launch_gemv(
                mod, interpreted, x, q, scale, None, bias, fmt, K, 0, N, (bn, bk, warps, st)),
                plain)


_GEMV_PTX_SCRIPT = """
import sys
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import triton
from csrc_triton import quant_gemm

fn = quant_gemm._wq_gemv_kernel
sig = {n: "i32" for n in fn.arg_names}
sig.update(x_ptr="*bf16", w_ptr="*u8", scale_ptr="*fp32", zero_ptr="*fp32",
           bias_ptr="*fp32", out_ptr="*bf16")
const = dict(FORMAT=1, GROUP=0, HALF=0, HAS_BIAS=False, BLOCK_N=8, BLOCK_K=1024,
             INTERPRETED=False, FLOAT_ZERO=False, LOOP_STAGES=int(sys.argv[1]), PDL=False,
             stride_sn=0)
sig.update({c: "constexpr" for c in const})
attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]]
         for n in ("x_ptr", "w_ptr", "out_ptr", "stride_wn", "K")}
try:
    ptx = triton.compile(ASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                         options=dict(num_warps=4, num_stages=2)).asm["ptx"]
except Exception as e:  # a Triton without its CUDA toolchain
    print(repr(e)[:300])
    sys.exit(3)
print("cp.async" in ptx)
"""


@pytest.mark.parametrize("stages,pipelined", [(1, False), (3, True)])
def test_gemv_loop_stages_pipeline_the_loads_for_hopper(stages, pipelined):
    """Compiled for sm_90 on this CPU (a process without the interpreter): LOOP_STAGES 3
    copies the weights asynchronously (cp.async), 1 loads them plainly."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root, os.path.join(root, "src"),
                                         env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, "-c", _GEMV_PTX_SCRIPT, str(stages)], env=env,
                         capture_output=True, text=True, timeout=120)
    if run.returncode == 3:
        pytest.skip(f"cannot compile for sm_90 here: {run.stdout.strip()}")
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().splitlines()[-1] == str(pipelined)


@pytest.mark.parametrize("M,N,K,group", [(1, 40, 200, 128), (3, 24, 600, 128),
                                         (16, 33, 256, 32), (1, 20, 96, 64)])
def test_int4_on_the_tensor_cores(M, N, K, group):
    """The tensor-core int4 kernels (int4 with 16-bit activations goes there; here
    interpreted, in fp32) against the dequantized matmul: a short last group, several
    groups, a bias; the sliced kernel with up to 16 rows of x (K split between its
    programs too), the tile kernel with more; and the dense path of many rows."""
    import csrc_triton
    from csrc_triton import quant_gemm

    torch.manual_seed(9)
    w, bias = torch.randn(N, K), torch.randn(N)
    packed, scale, zero = quantize_int4(w, group)
    deq = dequantize_int4(packed, scale, zero, K, group)
    half = int4_half(group, K)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(M, K).to(dtype)
        want = x.float() @ deq.t() + bias
        mod, interpreted = quant_gemm._kernels_for(x.device)
        config = quant_gemm.int4_mma_config(M, N, K, interpreted=True)
        got = quant_gemm._launch_int4_mma(mod, interpreted, x, packed, scale, zero, bias,
                                          group, half, N, config)
        assert got.dtype == dtype
        tol = 1e-4 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol * want.abs().max())
        # K split between the sliced kernel's programs too (the last adds the partials).
        for split in (2, 3):
            got = quant_gemm._launch_int4_mma(mod, interpreted, x, packed, scale, zero, bias,
                                              group, half, N, (*config, split))
            torch.testing.assert_close(got.float(), want, rtol=tol,
                                       atol=tol * want.abs().max())
        # More rows: the tile kernel, one program per [BLOCK_N, BLOCK_M] of the output.
        rows = torch.randn(M + 20, K).to(dtype)
        got = quant_gemm._launch_int4_mma(
            mod, interpreted, rows, packed, scale, zero, bias, group, half, N,
            quant_gemm.int4_path(M + 20, N, K, None)[1], tiles=True)
        want = rows.float() @ deq.t() + bias
        torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol * want.abs().max())
        # K split between programs (fp32 partial tiles, summed, then the bias).
        got = quant_gemm._launch_int4_mma(
            mod, interpreted, rows, packed, scale, zero, bias, group, half, N,
            (*quant_gemm.int4_path(M + 20, N, K, None)[1], 2), tiles=True)
        torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol * want.abs().max())
    one = torch.randn(1, K).bfloat16()
    assert quant_gemm._int4_mma_fits(one, zero, half)
    torch.testing.assert_close(csrc_triton.int4_gemm(one, packed, scale, zero, group).float(),
                               one.float() @ deq.t(), rtol=1e-2, atol=1e-2 * K ** 0.5)
    # Many rows: the weights dequantized by a kernel, then a dense matmul.
    many = torch.randn(quant_gemm.INT4_DENSE_MIN_ROWS, K)
    torch.testing.assert_close(csrc_triton.int4_gemm(many, packed, scale, zero, group, bias),
                               many @ deq.t() + bias, rtol=1e-4, atol=1e-4)


def test_int4_routing_by_rows_and_shape():
    """Which int4 kernel takes Llama-3.1-8B's projections on a GPU of 132 SMs: K split
    between tile programs only from 65 to 128 rows with at least as many inputs as
    outputs (o, down), where the sweep found it 1.1-1.4x the dense path."""
    from csrc_triton.quant_gemm import int4_path

    o, down, qkv, gate_up = (4096, 4096), (4096, 14336), (6144, 4096), (28672, 4096)
    assert int4_path(1, *down, 132) == ("sliced", (16, 8, 8, 4, 3, 2))  # K split in 2
    assert int4_path(1, *o, 132) == ("sliced", (16, 8, 4, 4, 3))
    assert int4_path(64, *down, 132) == ("tiles", (32, 64, 4, 4))
    for shape in (o, down):
        assert int4_path(65, *shape, 132) == ("tiles", (64, 128, 4, 3, 4))
        assert int4_path(128, *shape, 132) == ("tiles", (64, 128, 4, 3, 4))
        assert int4_path(129, *shape, 132) == ("dense", None)
    assert int4_path(128, *qkv, 132) == ("dense", None)
    assert int4_path(128, *gate_up, 132) == ("tiles", (128, 128, 8, 3))
    assert int4_path(512, *gate_up, 132) == ("dense", None)


@pytest.mark.parametrize("N,K", [(24, 200), (40, 77)])
def test_linear_gemv_with_16_bit_weights(N, K):
    """The GEMV kernel with the model's own weights (interpreted here), as batch-1 decode
    uses it for every projection: F.linear within rounding."""
    import csrc_triton

    torch.manual_seed(8)
    for dtype in (torch.bfloat16, torch.float16):
        linear = torch.nn.Linear(K, N, bias=True).to(dtype)
        x = torch.randn(1, K).to(dtype)
        want = (x.float() @ linear.weight.float().t() + linear.bias.float())
        got = csrc_triton.linear_gemv(x, linear.weight, linear.bias)
        assert got.dtype == dtype and got.shape == (1, N)
        torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(csrc_triton.linear_gemv(x, linear.weight).float(),
                                   want - linear.bias.float(), rtol=1e-2, atol=1e-2)
    with pytest.raises(ValueError):
        csrc_triton.linear_gemv(torch.randn(2, K).to(torch.bfloat16), linear.weight.bfloat16())


@pytest.mark.parametrize("I,K", [(20, 96), (7, 200)])
def test_gemv_with_silu_and_mul_epilogue(I, K):
    """Batch-1 gate/up with SiLU x up in the GEMV's epilogue (interpreted here): the same
    bytes as the plain GEMV followed by silu_and_mul, for 16-bit, fp8 and int8 weights
    and both 16-bit dtypes, a last program half full included (I odd)."""
    import csrc_triton

    torch.manual_seed(9)
    for dtype in (torch.bfloat16, torch.float16):
        x = torch.randn(1, K).to(dtype)
        for fmt, w, plain in gemv_formats(torch.nn.Linear(K, 2 * I, bias=False), dtype):
            got = csrc_triton.gemv_silu_and_mul(x, w)
            assert got.shape == (1, I) and got.dtype == dtype
            assert torch.equal(got, csrc_triton.silu_and_mul(plain(x))), (fmt, dtype)
    with pytest.raises(ValueError):  # fp32 rows are not taken (see _epilogue_launch)
        csrc_triton.gemv_silu_and_mul(torch.randn(1, K), w)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_gemv_with_rotary_and_kv_store_epilogue(cache_dtype):
    """Batch-1 q/k/v with the rotary embedding and the K/V store in the GEMV's epilogue
    (interpreted here): q and both caches hold the bytes of the plain GEMV followed by
    rotary_embedding with its store, for 16-bit, fp8 and int8 weights with a bias (Qwen2),
    a bf16 and an e4m3 cache; a negative slot stores nothing."""
    torch.manual_seed(10)
    hq, hkv, d, K = 2, 1, 16, 64
    rope = RotaryEmbedding(d, 32, 10000.0, None)
    x = torch.randn(1, K).to(torch.bfloat16)
    linear = torch.nn.Linear(K, (hq + 2 * hkv) * d, bias=True)
    for fmt, w, plain in gemv_formats(linear, torch.bfloat16):
        for slot in ((9, -1) if fmt == "w16" else (9,)):
            caches = assert_gemv_rotary_matches(x, w, plain, rope, (hq, hkv),
                                                torch.tensor([13, 0]), torch.tensor([slot, 0]),
                                                (3, 4), cache_dtype)
            for cache in caches:
                assert (cache.float().abs().sum() > 0) == (slot >= 0)


def test_fp8_bytes_decode_exactly_in_the_kernel():
    """Every e4m3 value (normal, subnormal, signed zero; NaN left out) through the
    weight-only fp8 kernel, as the identity's product: exactly torch's own decoding."""
    import csrc_triton

    codes = torch.arange(256, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0  # the two NaN codes
    w = codes.view(FP8).reshape(16, 16)
    got = csrc_triton.fp8_weight_gemm(torch.eye(16), w, torch.ones(16))
    assert torch.equal(got, w.float().t())
    # A single row too (the GEMV kernel).
    for row in (0, 7):
        got = csrc_triton.fp8_weight_gemm(torch.eye(16)[row:row + 1], w, torch.ones(16))
        assert torch.equal(got[0], w.float()[:, row])


@pytest.mark.parametrize("K", [100, 150])
def test_fp8_row_quantization_kernel_matches_torch(K):
    """The W8A8 activations' kernel (interpreted here, its e4m3 rounding in fp32 first)
    gives torch's bytes and scales: random rows of several magnitudes, a row
    of zeros, subnormals, ties and values rounding up into the next binade; rows held
    whole in one block (100 inputs) and read a block at a time (150)."""
    import csrc_triton

    torch.manual_seed(3)
    x = torch.randn(6, K) * torch.tensor([1e-3, 1.0, 30.0, 1.0, 1.0, 1.0])[:, None]
    x[3] = 0.0
    x[4, :8] = torch.tensor([448.0, 1e-4, -3e-3, 0.0, 2.0 ** -9, 1.0625, 1.1875, -239.9])
    x[5, :4] = torch.tensor([448.0, 2.0 ** -10 * 3, 15.5, -0.01])
    got_q, got_s = csrc_triton.fp8_quantize_rows(x)
    want_q, want_s = quantize_activations_fp8(x)
    assert torch.equal(got_s, want_s)
    assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8))


@pytest.mark.parametrize("M,N,K,bias", [(5, 40, 96, False), (33, 24, 100, True),
                                         (17, 48, 256, False)])
def test_fp8_split_k_matmul_matches_the_reference(M, N, K, bias):
    """W8A8's Triton matmul (interpreted): K split 1-4 ways, uneven K, a bias, the tile
    computed as it is or transposed (SWAP_AB); the partials summed in a fixed order (the
    same bytes on every call and from every split count within a rounding), and the split
    counters back at zero for the next call."""
    import csrc_triton
    from csrc_triton import fp8_mm
    from csrc_triton._split_k import split_counters

    torch.manual_seed(4)
    xq, xs = quantize_activations_fp8(torch.randn(M, K) * 3)
    q, s = quantize_fp8(torch.randn(N, K) * 0.05)
    b = torch.randn(N).to(torch.bfloat16) if bias else None
    want = (xq.float() @ q.float().t()) * xs * s[None, :]
    if bias:
        want = want.to(torch.bfloat16).float() + b.float()
    mod, interpreted = fp8_mm._kernels_for(torch.device("cpu"))
    assert interpreted
    for config in [(16, 16, 32, split, 1, 1) for split in (1, 2, 4)] + [
            (16, 16, 32, 3, 1, 1, True), (16, 32, 32, 4, 1, 1, True), (32, 16, 32, 2, 1, 1, True)]:
        for out_dtype in (torch.bfloat16, torch.float32):
            got = fp8_mm._launch(mod, True, xq, xs, q, s, b, out_dtype, config)
            assert got.dtype == out_dtype
            tol = 1e-5 if out_dtype == torch.float32 and not bias else 8e-3
            assert ((got.float() - want).abs().max() / want.abs().max()) < tol, (config,
                                                                                 out_dtype)
            again = fp8_mm._launch(mod, True, xq, xs, q, s, b, out_dtype, config)
            assert torch.equal(got, again)
    assert int(split_counters(torch.device("cpu")).abs().sum()) == 0
    # The public entry point: the interpreter's configuration.
    got = csrc_triton.fp8_scaled_mm(xq, xs, q, s, b)
    assert ((got.float() - want).abs().max() / want.abs().max()) < 8e-3


@pytest.mark.parametrize("sm_count", [132, 58])
def test_fp8_matmul_configs_fit_in_shared_memory(sm_count):
    """The W8A8 kernel's configurations on real projection shapes (Llama-3.1-8B, Qwen2.5-0.5B,
    Qwen3-0.6B) at every decode-sized row count: the pipeline's shared memory (stages x
    (BLOCK_M + BLOCK_N) x BLOCK_K bytes, what Triton 3.6 allocates for it on sm_90a) fits
    the 99 KB a block may use on sm_89 GPUs (L4, L40S), not only Hopper's 227 KB; the
    transposed tile takes up to 32 rows and pads them to 16 or 32; past 128 rows cuBLAS."""
    from csrc_triton.fp8_mm import fp8_mm_config

    shapes = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336),  # Llama-3.1-8B
              (1152, 896), (896, 896), (9728, 896), (896, 4864),  # Qwen2.5-0.5B
              (4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)]  # Qwen3-0.6B
    for N, K in shapes:
        for M in range(1, 257):
            config = fp8_mm_config(M, N, K, sm_count)
            if M > 128:
                assert config is None
            if config is None:
                continue
            bm, bn, bk, split, warps, stages, swap = (*config, False)[:7]
            assert stages * (bm + bn) * bk <= 101376, (M, N, K, config)
            assert bool(swap) == (M <= 32), (M, config)
            assert bm >= M if swap else bm in (64, 128), (M, config)
            assert split in (1, 2, 4) and warps in (4, 8)


def test_fp8_activations_from_the_norm_kernels(tiny_model_dirs, monkeypatch):
    """With the fused kernels (interpreted here), a W8A8 step's norms write e4m3 rows and
    scales for the projections after them: the logits equal those of the same kernels
    writing 16 bits and the projections rounding them, bit for bit; a step of one token
    keeps 16 bits."""
    pytest.importorskip("triton")
    from minivllm.model import llama, quantization

    monkeypatch.setenv("MINIVLLM_FUSED_OPS", "1")
    llm = LLM(str(tiny_model_dirs["llama"]), skip_tokenizer_init=True, max_model_len=64,
              quantization="fp8")
    assert llm.engine.runner.model.model.fused_ops
    handed = []

    def counted(layer, tokens, device):
        fp8 = quantization.fp8_activations_for(layer, tokens, device)
        handed.append(fp8 is not None)
        return fp8

    # 12 tokens: above FP8_ACTIVATION_MIN_TOKENS (the count of handed buffers below fails
    # if not); each token is a program of every interpreted kernel, run three times here.
    prompt = torch.tensor(random_prompts(1, 256, 12, 12, seed=8)[0])
    monkeypatch.setattr(llama, "fp8_activations_for", counted)
    fused = _prompt_logits(llm.engine.runner, prompt)
    assert sum(handed) == 2 * 2  # qkv and gate/up in each of 2 layers
    handed.clear()
    _prompt_logits(llm.engine.runner, prompt[:quantization.FP8_ACTIVATION_MIN_TOKENS])
    assert handed and not any(handed)
    monkeypatch.setattr(llama, "fp8_activations_for", lambda *a: None)
    assert torch.equal(fused, _prompt_logits(llm.engine.runner, prompt))


def test_benchmark_perplexity_matches_transformers(tiny_model_dirs):
    """bench.quant_accuracy's perplexity (prompt logprobs through the engine, windows
    scored from their own start) is the one transformers' logits give; its agreement is
    the share before the first difference."""
    from transformers import AutoModelForCausalLM

    from bench.quant_accuracy import agreement, perplexity

    ids = random_prompts(1, 256, 70, 70, seed=11)[0]
    llm = LLM(str(tiny_model_dirs["llama"]), skip_tokenizer_init=True, max_model_len=64)
    ppl, count = perplexity(llm, ids, 32)
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dirs["llama"], dtype=torch.float32)
    nll, n = 0.0, 0
    for i in range(0, len(ids), 32):
        w = torch.tensor([ids[i:i + 32]])
        if w.shape[1] < 2:
            continue
        with torch.no_grad():
            lp = torch.log_softmax(hf(w).logits[0, :-1].float(), -1)
        nll -= lp.gather(1, w[0, 1:, None]).sum().item()
        n += w.shape[1] - 1
    assert count == n
    assert abs(ppl - __import__("math").exp(nll / n)) < 1e-3 * ppl
    assert agreement([[1, 2, 3, 4], [5, 6]], [[1, 2, 9, 4], [5, 6]]) == (0.75, 1)


def test_fp8_kv_cache(tiny_model_dirs, monkeypatch):
    """kv_cache_dtype="fp8": the cache holds e4m3 (a quarter of fp32's bytes per block), the
    engine generates through it with logprobs close to the full-precision cache's, the
    Triton kernels (interpreted here) give the reference attention's tokens, and the pool
    ends whole."""
    from minivllm.worker.kv_cache import block_bytes

    prompts = random_prompts(4, 256, 5, 30, seed=12)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=0)
    kw = dict(skip_tokenizer_init=True, max_model_len=128, block_size=4)
    base = LLM(str(tiny_model_dirs["qwen3"]), **kw)
    fp8 = LLM(str(tiny_model_dirs["qwen3"]), kv_cache_dtype="fp8", **kw)
    layer = fp8.engine.runner.kv_cache.layers[0][0]
    assert layer.dtype == FP8
    cfg = fp8.engine.model_config
    assert block_bytes(cfg, 4, FP8) * 4 == block_bytes(cfg, 4, torch.float32)
    a = base.generate(prompts, params, use_tqdm=False)
    b = fp8.generate(prompts, params, use_tqdm=False)
    same = 0
    for x, y in zip(a, b):
        tx, ty = x.outputs[0].token_ids, y.outputs[0].token_ids
        same += tx[0] == ty[0]
        # the first token's logprob under each cache (same context: the prompt)
        lx = x.outputs[0].logprobs[0][tx[0]].logprob
        ly = y.outputs[0].logprobs[0][ty[0]].logprob
        assert abs(lx - ly) < 0.25
    assert same >= 3
    assert fp8.engine.scheduler.pool.all_free()
    monkeypatch.setenv("MINIVLLM_ATTENTION_BACKEND", "triton")
    kernels = LLM(str(tiny_model_dirs["qwen3"]), kv_cache_dtype="fp8", **kw)
    few = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)  # (interpreted: slow)
    # the two shortest prompts (17 and 16 tokens, several blocks each)
    c = kernels.generate(prompts[2:], few, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in c] == [o.outputs[0].token_ids[:6] for o in b[2:]]
    assert kernels.engine.scheduler.pool.all_free()
    with pytest.raises(ValueError, match="kv_cache_dtype must be"):
        LLM(str(tiny_model_dirs["qwen3"]), kv_cache_dtype="int8", **kw)