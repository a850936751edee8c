"""Checkpoints quantized ahead (model/prequantized.py: GPTQ, AWQ, compressed-tensors, FP8):
tiny models whose projections are packed here in each format's layout (written from the
formats' descriptions, not with the reader's code) load to exactly the weights they
encode, and generate what a full-precision checkpoint of those weights generates."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from minivllm import LLM, SamplingParams
from minivllm.model.prequantized import (AWQ_ORDER, unpack_along_columns,
                                         unpack_along_rows)
from minivllm.model.quantization import (QuantizedLinear, int4_half, quantize_int4,
                                         unpack_int4)
from conftest import make_hf_model, random_prompts

GROUP = 32
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def to_int32(words: torch.Tensor) -> torch.Tensor:
    """uint32 values held in int64 -> the int32 with those bits."""
    return (words - (words >= 2 ** 31).long() * 2 ** 32).to(torch.int32)


def pack_gptq_rows(q: torch.Tensor) -> torch.Tensor:
    """[K, N] codes -> [K / 8, N]: input 8r + j in nibble j of word r."""
    out = torch.zeros(q.shape[0] // 8, q.shape[1], dtype=torch.int64)
    for j in range(8):
        out |= q[j::8].long() << (4 * j)
    return to_int32(out)


def pack_columns(q: torch.Tensor, order=tuple(range(8))) -> torch.Tensor:
    """[R, C] codes -> [R, C / 8]: column 8c + order[i] in nibble i of word c."""
    out = torch.zeros(q.shape[0], q.shape[1] // 8, dtype=torch.int64)
    for i in range(8):
        out |= q[:, order[i]::8].long() << (4 * i)
    return to_int32(out)


def assert_same_greedy_output(q, ref, prompts: int, longest: int, tokens: int, seed: int):
    """Greedy tokens of two engines on the same random prompts (5 to `longest` tokens)."""
    batch = random_prompts(prompts, 256, 5, longest, seed=seed)
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in q.generate(batch, params, use_tqdm=False)]
    want = [o.outputs[0].token_ids for o in ref.generate(batch, params, use_tqdm=False)]
    assert got == want


def projection_weights(state: dict):
    """(name, module name, weight) of each decoder projection's weight in a state dict."""
    for name, w in state.items():
        module, _, leaf = name.rpartition(".")
        if leaf == "weight" and module.rpartition(".")[2] in PROJECTIONS:
            yield name, module, w


def save_pair(folder, cfg: dict, quant: dict, reference: dict, qc: dict):
    """(quantized checkpoint folder, full-precision one), both under `folder`, sharing the
    model config (the quantized one with quantization_config qc)."""
    dirs = []
    for label, tensors, extra in (("q", quant, {"quantization_config": qc}),
                                  ("reference", reference, {})):
        d = folder / label
        d.mkdir(parents=True)
        tensors = {k: v.contiguous() for k, v in tensors.items()
                   if not (k == "lm_head.weight" and cfg.get("tie_word_embeddings"))}
        save_file(tensors, str(d / "model.safetensors"))
        (d / "config.json").write_text(json.dumps({**cfg, **extra}))
        dirs.append(d)
    return tuple(dirs)


def test_unpacking_inverts_each_layout():
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (16, 24), generator=g)
    assert torch.equal(unpack_along_rows(pack_gptq_rows(q)), q)
    assert torch.equal(unpack_along_columns(pack_columns(q)), q)
    assert torch.equal(unpack_along_columns(pack_columns(q, AWQ_ORDER), AWQ_ORDER), q)
    # The AWQ order really is an interleave: read plainly, the columns come out permuted.
    assert not torch.equal(unpack_along_columns(pack_columns(q, AWQ_ORDER)), q)


# Projections that share their input, and so one act-order input order in a checkpoint.
_SAME_INPUT = {"q_proj": "attn", "k_proj": "attn", "v_proj": "attn", "gate_proj": "mlp",
               "up_proj": "mlp"}


def write_checkpoints(family: str, fmt: str, tmp_path, sym: bool = False,
                      act_order: bool = False):
    """(quantized checkpoint folder, full-precision folder of the weights it encodes).
    act_order (GPTQ desc_act): each group takes its inputs from a random order of the
    row's inputs (shared by projections with one input), stored in input order with
    g_idx naming each input's group."""
    model = make_hf_model(family)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    quant, reference = {}, dict(state)
    for name, module, w in projection_weights(state):
        if act_order:
            layer, proj = module.rpartition(".")[0], module.rpartition(".")[2]
            key = f"{layer}.{_SAME_INPUT.get(proj, proj)}"
            gen = torch.Generator().manual_seed(sum(map(ord, key)))
            order = torch.randperm(w.shape[1], generator=gen)  # the quantization order
            rank = torch.argsort(order)  # input i is the rank[i]-th quantized
            packed, scale, zero = quantize_int4(w[:, order], GROUP)
            codes = unpack_int4(packed, w.shape[1], int4_half(GROUP, w.shape[1]))[:, rank]
            g_idx = (rank // GROUP).to(torch.int32)
            scale16 = scale.half()
            reference[name] = (codes.float() - zero.float()[:, g_idx.long()]) \
                * scale16.float()[:, g_idx.long()]
            if fmt == "compressed-tensors":  # actorder "group"
                quant[module + ".weight_packed"] = pack_columns(codes)
                quant[module + ".weight_scale"] = scale16
                quant[module + ".weight_shape"] = torch.tensor(list(w.shape))
                quant[module + ".weight_zero_point"] = pack_gptq_rows(zero)
                quant[module + ".weight_g_idx"] = g_idx
                continue
            quant[module + ".qweight"] = pack_gptq_rows(codes.t().contiguous())
            quant[module + ".qzeros"] = pack_columns((zero.t().long() - 1) & 0xF)  # v1
            quant[module + ".g_idx"] = g_idx
            quant[module + ".scales"] = scale16.t().contiguous()
            continue
        packed, scale, zero = quantize_int4(w, GROUP)
        if sym:
            zero = torch.full_like(zero, 8)
            scale = (w.abs().reshape(w.shape[0], -1, GROUP).amax(2) / 7.5).clamp(min=1e-8)
            codes = torch.round(w.reshape(w.shape[0], -1, GROUP) / scale[..., None]) + 8
            codes = codes.clamp(0, 15).reshape(w.shape).to(torch.uint8)
        else:
            codes = unpack_int4(packed, w.shape[1], int4_half(GROUP, w.shape[1]))
        scale16 = scale.half()
        deq = (codes.float() - zero.float().repeat_interleave(GROUP, 1)) \
            * scale16.float().repeat_interleave(GROUP, 1)
        reference[name] = deq
        qt, zt, st = codes.t().contiguous(), zero.t().contiguous(), scale16.t().contiguous()
        if fmt == "compressed-tensors":
            # Codes q + 8 (q in [-8, 7]) and zero points z + 8, as stored: the same numbers
            # as the unsigned codes and zero points here.
            quant[module + ".weight_packed"] = pack_columns(codes)  # along the inputs
            quant[module + ".weight_scale"] = scale16
            quant[module + ".weight_shape"] = torch.tensor(list(w.shape))
            if sym:  # some writers keep a symmetric scheme's zero points: zeros, unpacked
                quant[module + ".weight_zero_point"] = torch.zeros_like(zero, dtype=torch.int8)
            else:
                quant[module + ".weight_zero_point"] = pack_gptq_rows(zero)  # along outputs
                quant[module + ".weight_g_idx"] = torch.arange(w.shape[1],
                                                               dtype=torch.int32) // GROUP
            continue
        if fmt == "awq":
            quant[module + ".qweight"] = pack_columns(qt, AWQ_ORDER)
            quant[module + ".qzeros"] = pack_columns(zt, AWQ_ORDER)
        else:
            quant[module + ".qweight"] = pack_gptq_rows(qt)
            stored = zt.long() - (1 if fmt == "gptq" else 0)  # v1 keeps zero - 1
            quant[module + ".qzeros"] = pack_columns(stored & 0xF)
            quant[module + ".g_idx"] = torch.arange(w.shape[1], dtype=torch.int32) // GROUP
        quant[module + ".scales"] = st
    projections = {name for name, _, _ in projection_weights(state)}
    quant.update((name, t) for name, t in state.items() if name not in projections)
    if fmt == "awq":
        qc = {"quant_method": "awq", "bits": 4, "group_size": GROUP, "version": "gemm",
              "zero_point": True}
    elif fmt == "compressed-tensors":
        qc = {"quant_method": "compressed-tensors", "format": "pack-quantized",
              "ignore": ["lm_head"], "quantization_status": "compressed",
              "config_groups": {"group_0": {
                  "targets": ["Linear"], "input_activations": None,
                  "weights": {"num_bits": 4, "type": "int", "symmetric": sym,
                              "strategy": "group", "group_size": GROUP,
                              "actorder": "group" if act_order else None}}}}
    else:
        qc = {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": act_order,
              "sym": sym, "checkpoint_format": fmt}
    return save_pair(tmp_path / f"{family}-{fmt}", model.config.to_dict(), quant, reference, qc)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("fmt,sym", [("gptq", False), ("gptq", True), ("gptq_v2", False),
                                     ("awq", False), ("compressed-tensors", False),
                                     ("compressed-tensors", True)])
def test_checkpoint_loads_the_weights_it_encodes(tmp_path, family, fmt, sym):
    qdir, rdir = write_checkpoints(family, fmt, tmp_path, sym)
    kw = dict(skip_tokenizer_init=True, max_model_len=128)
    q = LLM(str(qdir), **kw)
    ref = LLM(str(rdir), **kw)
    qmodel, rmodel = q.engine.runner.model, ref.engine.runner.model
    for qlayer, rlayer in zip(qmodel.model.layers, rmodel.model.layers):
        for qm, rm in ((qlayer.self_attn.qkv_proj, rlayer.self_attn.qkv_proj),
                       (qlayer.mlp.gate_up_proj, rlayer.mlp.gate_up_proj),
                       (qlayer.mlp.down_proj, rlayer.mlp.down_proj)):
            assert isinstance(qm, QuantizedLinear) and qm.group_size == GROUP
            torch.testing.assert_close(qm.dequantized_weight(), rm.weight.float(),
                                       rtol=0, atol=1e-6)
            if rm.bias is not None:
                torch.testing.assert_close(qm.bias, rm.bias)
    assert_same_greedy_output(q, ref, 4, 20, 10, seed=3)
    assert q.engine.scheduler.pool.all_free()


def write_fp8_checkpoints(fmt: str, tmp_path, family: str = "qwen2"):
    """(FP8 checkpoint folder, full-precision folder of the weights it encodes): per-tensor
    scales as AutoFP8 writes them ("fp8-tensor"), per-channel as llm-compressor does
    ("compressed-tensors-channel")."""
    from minivllm.model.quantization import FP8, FP8_MAX

    model = make_hf_model(family)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    quant, reference = {}, dict(state)
    per_channel = fmt.endswith("channel")
    for name, w in state.items():
        module, _, leaf = name.rpartition(".")
        if leaf != "weight" or module.rpartition(".")[2] not in PROJECTIONS:
            continue
        amax = w.abs().amax(1, keepdim=True) if per_channel else w.abs().amax()
        scale = (amax / FP8_MAX).float()
        q = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        quant[name] = q
        quant[module + ".weight_scale"] = scale.reshape(-1, 1) if per_channel else scale
        quant[module + ".input_scale"] = torch.tensor(0.05)  # static scales: not used
        if module.endswith("k_proj"):  # calibrated KV-cache scales: not used either
            kv_scale = ".k_proj.output_scale" if not per_channel else ".k_scale"
            quant[module.rpartition(".")[0] + kv_scale] = torch.tensor(0.5)
        reference[name] = q.float() * scale
    for name, t in state.items():
        quant.setdefault(name, t)
    qc = {"quant_method": "fp8", "activation_scheme": "static"} if not per_channel else {
        "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
            "input_activations": {"num_bits": 8, "type": "float", "dynamic": True}}}}
    return save_pair(tmp_path, model.config.to_dict(), quant, reference, qc)


@pytest.mark.parametrize("fmt", ["fp8-tensor", "compressed-tensors-channel"])
def test_fp8_checkpoint_loads_the_weights_it_encodes(tmp_path, fmt):
    """FP8 checkpoints (e4m3 weights with per-tensor or per-channel scales, as AutoFP8 and
    llm-compressor write them): the loaded layers hold those weights, and small steps
    (weight-only there) give the tokens of a full-precision checkpoint of them."""
    from minivllm.model.quantization import FP8

    dirs = write_fp8_checkpoints(fmt, tmp_path)
    # Steps of one token (FP8_ACTIVATION_MIN_TOKENS): the weight-only kernel's.
    kw = dict(skip_tokenizer_init=True, max_model_len=128, max_num_batched_tokens=1,
              max_num_seqs=1)
    q, ref = LLM(str(dirs[0]), **kw), LLM(str(dirs[1]), **kw)
    layer = q.engine.runner.model.model.layers[0].self_attn.qkv_proj
    assert isinstance(layer, QuantizedLinear) and layer.method == "fp8"
    assert layer.qweight.dtype == FP8 and layer.scale.dtype == torch.float32
    torch.testing.assert_close(
        layer.dequantized_weight(),
        ref.engine.runner.model.model.layers[0].self_attn.qkv_proj.weight.float(),
        rtol=0, atol=0)
    assert_same_greedy_output(q, ref, 3, 10, 8, seed=4)


def test_compressed_tensors_by_channel_reads_one_group_a_row():
    """W4A16 by channel: one scale (and zero point) per output row over all its inputs."""
    from minivllm.model.prequantized import PackedParts, checkpoint_quantization

    g = torch.Generator().manual_seed(5)
    out_f, in_f = 16, 40  # 40 inputs: the last packed word holds padding
    codes = torch.randint(0, 16, (out_f, in_f), generator=g)
    zero = torch.randint(4, 12, (out_f, 1), generator=g)
    scale = torch.rand(out_f, 1, generator=g).half() + 0.1
    padded = torch.nn.functional.pad(codes, (0, 8 - in_f % 8))
    quant = checkpoint_quantization({"quantization_config": {
        "quant_method": "compressed-tensors", "format": "pack-quantized",
        "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int", "symmetric": False,
                                            "strategy": "channel"}}}}})
    assert quant.group_size == -1 and quant.zero_points
    parts = PackedParts(quant)
    tensors = {"weight_packed": pack_columns(padded), "weight_scale": scale,
               "weight_shape": torch.tensor([out_f, in_f]),
               "weight_zero_point": pack_gptq_rows(zero)}
    layouts = [parts.add("p", name, t) for name, t in tensors.items()]
    assert layouts[:3] == [None] * 3
    packed, got_scale, got_zero = layouts[3]
    unpacked = unpack_int4(packed, in_f, int4_half(in_f, in_f))
    assert torch.equal(unpacked.long(), codes)
    assert torch.equal(got_zero.long(), zero) and torch.equal(got_scale, scale.float())
    parts.check_done()


@pytest.mark.parametrize("family,fmt", [("llama", "gptq"), ("qwen2", "gptq"),
                                        ("llama", "compressed-tensors")])
def test_act_order_checkpoint_loads_the_weights_it_encodes(tmp_path, family, fmt):
    """GPTQ desc_act true (compressed-tensors: actorder "group"): each projection's packed
    inputs are reordered so that its groups are adjacent, the layer reorders x the same
    way, and the model generates what the full-precision checkpoint of the encoded
    weights generates."""
    qdir, rdir = write_checkpoints(family, fmt, tmp_path, act_order=True)
    kw = dict(skip_tokenizer_init=True, max_model_len=128)
    q, ref = LLM(str(qdir), **kw), LLM(str(rdir), **kw)
    for qlayer, rlayer in zip(q.engine.runner.model.model.layers,
                              ref.engine.runner.model.model.layers):
        for qm, rm in ((qlayer.self_attn.qkv_proj, rlayer.self_attn.qkv_proj),
                       (qlayer.self_attn.o_proj, rlayer.self_attn.o_proj),
                       (qlayer.mlp.gate_up_proj, rlayer.mlp.gate_up_proj),
                       (qlayer.mlp.down_proj, rlayer.mlp.down_proj)):
            perm = qm.input_perm
            assert perm is not None and not torch.equal(perm, torch.arange(len(perm)))
            torch.testing.assert_close(qm.dequantized_weight(), rm.weight.float()[:, perm],
                                       rtol=0, atol=1e-6)
    assert_same_greedy_output(q, ref, 4, 20, 10, seed=3)


def test_gptq_act_order_parts_of_a_fused_layer_must_share_their_input_order(tmp_path):
    """q, k and v read one input: a checkpoint whose g_idx orders them differently cannot
    run as one fused projection, and says so."""
    qdir, _ = write_checkpoints("llama", "gptq", tmp_path, act_order=True)
    from safetensors.torch import load_file
    tensors = load_file(str(qdir / "model.safetensors"))
    name = next(n for n in tensors if n.endswith("k_proj.g_idx"))
    tensors[name] = tensors[name].flip(0).contiguous()
    save_file(tensors, str(qdir / "model.safetensors"))
    with pytest.raises(ValueError, match="unlike the other parts of its fused layer"):
        LLM(str(qdir), skip_tokenizer_init=True, max_model_len=128)


@pytest.mark.parametrize("fmt", ["weight_block_size", "compressed-tensors-block"])
def test_block_fp8_checkpoint_is_dequantized_at_load(tmp_path, fmt):
    """Block-wise FP8 (DeepSeek's / Qwen's weight_scale_inv, llm-compressor's "block"
    strategy): the projections load as the full-precision weights the blocks encode, and
    quantization="fp8" quantizes those again per channel, as for a full-precision
    checkpoint of them."""
    from minivllm.model.quantization import FP8, FP8_MAX

    block = [16, 24]  # does not divide every projection: the edge blocks are partial
    model = make_hf_model("qwen2")
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    quant, reference = {}, dict(state)
    for name, module, w in projection_weights(state):
        rows, cols = -(-w.shape[0] // block[0]), -(-w.shape[1] // block[1])
        padded = torch.zeros(rows * block[0], cols * block[1])
        padded[:w.shape[0], :w.shape[1]] = w
        amax = padded.reshape(rows, block[0], cols, block[1]).abs().amax((1, 3))
        scale = (amax / FP8_MAX).clamp(min=1e-12)
        full = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
        full = full[:w.shape[0], :w.shape[1]]
        q = (w / full).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        quant[name] = q
        scale_name = "weight_scale" if fmt.startswith("compressed") else "weight_scale_inv"
        quant[f"{module}.{scale_name}"] = scale
        reference[name] = q.float() * full
    for name, t in state.items():
        quant.setdefault(name, t)
    qc = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": block}
    if fmt.startswith("compressed"):
        qc = {"quant_method": "compressed-tensors", "format": "float-quantized",
              "ignore": ["lm_head"], "config_groups": {"group_0": {
                  "targets": ["Linear"], "input_activations": {
                      "num_bits": 8, "type": "float", "strategy": "group", "group_size": 128,
                      "dynamic": True},
                  "weights": {"num_bits": 8, "type": "float", "strategy": "block",
                              "block_structure": block}}}}
    dirs = save_pair(tmp_path, model.config.to_dict(), quant, reference, qc)
    kw = dict(skip_tokenizer_init=True, max_model_len=128)
    prompts = random_prompts(3, 256, 5, 10, seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for method in (None, "fp8"):
        q = LLM(str(dirs[0]), quantization=method, **kw)
        ref = LLM(str(dirs[1]), quantization=method, **kw)
        qm = q.engine.runner.model.model.layers[0].self_attn.qkv_proj
        rm = ref.engine.runner.model.model.layers[0].self_attn.qkv_proj
        if method is None:
            assert isinstance(qm, torch.nn.Linear)
            torch.testing.assert_close(qm.weight, rm.weight, rtol=0, atol=0)
        else:
            assert isinstance(qm, QuantizedLinear) and qm.method == "fp8"
            torch.testing.assert_close(qm.dequantized_weight(), rm.dequantized_weight(),
                                       rtol=0, atol=0)
        got = [o.outputs[0].token_ids for o in q.generate(prompts, params, use_tqdm=False)]
        want = [o.outputs[0].token_ids for o in ref.generate(prompts, params, use_tqdm=False)]
        assert got == want


@pytest.mark.parametrize("fmt", ["int-quantized", "pack-quantized"])
def test_compressed_tensors_int8_checkpoint_loads_the_weights_it_encodes(tmp_path, fmt):
    """llm-compressor's 8-bit integer weights by channel (W8A8 "int-quantized", its
    activations run unquantized; W8A16 "pack-quantized", four codes a word stored as
    q + 128): the layers hold those weights and generate what a full-precision checkpoint
    of them generates."""
    model = make_hf_model("llama")
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    quant, reference = {}, dict(state)
    for name, module, w in projection_weights(state):
        scale = (w.abs().amax(1, keepdim=True) / 127).clamp(min=1e-12)
        q = torch.round(w / scale).clamp(-128, 127).to(torch.int8)
        if fmt == "int-quantized":
            quant[name] = q
            quant[module + ".weight_zero_point"] = torch.zeros_like(scale, dtype=torch.int8)
        else:
            stored = (q.long() + 128).reshape(q.shape[0], -1, 4)
            words = sum(stored[:, :, i] << (8 * i) for i in range(4))
            quant[module + ".weight_packed"] = to_int32(words)
            quant[module + ".weight_shape"] = torch.tensor(list(w.shape))
        quant[module + ".weight_scale"] = scale.half()
        reference[name] = q.float() * scale.half().float()
    projections = {name for name, _, _ in projection_weights(state)}
    quant.update((name, t) for name, t in state.items() if name not in projections)
    acts = {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True,
            "symmetric": True} if fmt == "int-quantized" else None
    qc = {"quant_method": "compressed-tensors", "format": fmt, "ignore": ["lm_head"],
          "config_groups": {"group_0": {
              "targets": ["Linear"], "input_activations": acts,
              "weights": {"num_bits": 8, "type": "int", "strategy": "channel",
                          "symmetric": True}}}}
    dirs = save_pair(tmp_path, model.config.to_dict(), quant, reference, qc)
    kw = dict(skip_tokenizer_init=True, max_model_len=128)
    q, ref = LLM(str(dirs[0]), **kw), LLM(str(dirs[1]), **kw)
    for qlayer, rlayer in zip(q.engine.runner.model.model.layers,
                              ref.engine.runner.model.model.layers):
        for qm, rm in ((qlayer.self_attn.qkv_proj, rlayer.self_attn.qkv_proj),
                       (qlayer.mlp.down_proj, rlayer.mlp.down_proj)):
            assert isinstance(qm, QuantizedLinear) and qm.method == "int8"
            torch.testing.assert_close(qm.dequantized_weight(), rm.weight.float(),
                                       rtol=0, atol=1e-6)
    assert_same_greedy_output(q, ref, 3, 10, 8, seed=4)


def test_a_gptq_target_takes_a_full_precision_draft_model(tmp_path):
    """The draft model reads its own checkpoint's quantization, not the target's: a GPTQ
    target speculates with the 16-bit model it was made from, token for token as alone."""
    qdir, rdir = write_checkpoints("llama", "gptq", tmp_path, False)
    kw = dict(skip_tokenizer_init=True, max_model_len=128)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5 + i, 9, 11, 5 + i, 9]} for i in range(3)]
    want = [o.outputs[0].token_ids for o in LLM(str(qdir), **kw).generate(
        prompts, params, use_tqdm=False)]
    spec = LLM(str(qdir), quantization="gptq", **kw,  # named, as a user may
               speculative_config={"method": "draft_model", "model": str(rdir),
                                   "num_speculative_tokens": 3})
    assert spec.engine.drafter.runner.cfg.quantization is None
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)]
    assert got == want
