"""Read GGUF checkpoints (llama.cpp's format) as Hugging Face-style float32 weights.

Supported architectures (``general.architecture``): ``llama`` (which in llama.cpp
also covers Mistral and SmolLM), ``qwen2`` and ``qwen3``.

Public API
----------
``load_gguf_state(path) -> (config: dict, tensors: Iterator[(hf_name, torch.Tensor)])``
    The main entry point. ``config`` is a Hugging Face ``config.json``-style dict
    built from the GGUF metadata (see :func:`build_hf_config`); ``tensors`` lazily
    dequantizes every weight to a contiguous float32 CPU tensor and yields it
    under its Hugging Face parameter name with the Hugging Face shape.

``iter_gguf_tensors(path_or_reader) -> Iterator[(hf_name, torch.Tensor)]``
    Only the tensors (same as the second element above).

``read_gguf_metadata(path_or_reader, *, with_vocab=False) -> dict``
    The metadata key/values as plain Python values. The big tokenizer arrays
    (``tokenizer.ggml.tokens``/``merges``/``token_type``/``scores``) are only
    included when ``with_vocab=True``; otherwise they are replaced by their length.

``build_hf_config(metadata, tensor_names, rope_freqs=None) -> dict``
    The ``config.json`` dict (``architectures``, ``model_type``, ``hidden_size``,
    ``intermediate_size``, ``num_hidden_layers``, ``num_attention_heads``,
    ``num_key_value_heads``, ``head_dim``, ``rms_norm_eps``, ``rope_theta`` (also as
    v5-style ``rope_parameters``), ``max_position_embeddings``, ``vocab_size``,
    ``tie_word_embeddings`` (true iff there is no ``output.weight`` tensor),
    ``bos/eos/pad_token_id``, ``torch_dtype``/``dtype`` = ``"float32"``, ...).

``gguf_name_to_hf(name) -> str | None``
    Tensor name mapping (``blk.3.attn_q.weight`` ->
    ``model.layers.3.self_attn.q_proj.weight``); ``None`` for tensors that have no
    Hugging Face counterpart and are skipped (``rope_freqs.weight``: Llama 3's RoPE
    scaling as per-frequency factors, which ``build_hf_config`` turns back into the
    ``llama3`` ``rope_scaling`` they were computed from).

``permute_qk_to_gguf(w, n_head)`` / ``unpermute_qk_from_gguf(w, n_head)``
    llama.cpp's Q/K row permutation and its inverse (see below).

``convert_gguf_to_hf_dir(gguf_path, out_dir, *, tokenizer=True) -> Path``
    Writes ``config.json``, ``model.safetensors`` (float32; no ``lm_head.weight``
    when the embeddings are tied), ``generation_config.json`` and, when the file
    carries a tokenizer, the tokenizer files (built by transformers from the GGUF
    metadata, ``tokenizer_config.json`` holding the chat template). The result
    loads with ``AutoModelForCausalLM.from_pretrained(out_dir)``.

Layout details
--------------
* GGUF stores dimensions innermost-first (``ne[0]`` is the row length), so a
  Hugging Face ``[out_features, in_features]`` Linear weight is listed as
  ``[in, out]`` in the GGUF tensor info; the reader's data arrays are already in
  row-major ``[out, in]`` order, and dequantization keeps that.
* Q/K permutation (``llama`` architecture only): llama.cpp's
  ``convert_hf_to_gguf.py`` (``LlamaModel.permute``) reorders the rows of the
  ``q_proj``/``k_proj`` weights (and biases, if any) *within each head* from
  Hugging Face's "rotate-half" RoPE layout (first half of the head dims paired
  with the second half) to the GPT-J "interleaved" layout that ggml's normal
  RoPE uses (pairs of adjacent dims)::

      gguf = hf.reshape(n_head, 2, head_dim // 2, in).swapaxes(1, 2).reshape(out, in)

  with ``n_head = head_count`` for Q and ``n_head = head_count_kv`` for K. We
  apply the inverse, ``reshape(n_head, head_dim // 2, 2, in).swapaxes(1, 2)``,
  exactly like transformers' ``LlamaTensorProcessor``. Qwen2/Qwen3 use NeoX
  RoPE in llama.cpp and are stored unpermuted.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np
import torch

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "build_hf_config",
    "convert_gguf_to_hf_dir",
    "gguf_name_to_hf",
    "iter_gguf_tensors",
    "load_gguf_state",
    "open_gguf",
    "permute_qk_to_gguf",
    "read_gguf_metadata",
    "unpermute_qk_from_gguf",
]

# GGUF architecture -> (HF model_type, HF architecture class)
SUPPORTED_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
}
# Architectures whose Q/K rows llama.cpp permuted when converting.
_PERMUTED_QK_ARCHITECTURES = frozenset({"llama"})

_TOP_LEVEL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Tensors with no HF counterpart; skipped (with a warning where it matters).
_SKIPPED_NAMES = frozenset({"rope_freqs.weight"})
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_VOCAB_KEYS = frozenset(
    {"tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type", "tokenizer.ggml.scores"}
)

PathLike = str | os.PathLike


# --------------------------------------------------------------------------------------
# reading
# --------------------------------------------------------------------------------------
_last_reader: tuple = (None, None)  # ((path, size, mtime), reader) of the last open


def open_gguf(path: PathLike):
    """A ``gguf.GGUFReader`` on ``path`` (memory-mapped, read-only). The last one opened is
    kept and handed out again while the file is unchanged: opening parses every metadata
    field in Python (3.5 s for SmolLM2's 49,152-token vocabulary), and loading a .gguf
    model opens it twice, for its config and for its weights."""
    import gguf

    global _last_reader
    stat = os.stat(path)
    key = (os.path.abspath(path), stat.st_size, stat.st_mtime_ns)
    if _last_reader[0] != key:
        _last_reader = (key, gguf.GGUFReader(os.fspath(path), "r"))
    return _last_reader[1]


def _as_reader(path_or_reader):
    if isinstance(path_or_reader, (str, os.PathLike)):
        return open_gguf(path_or_reader)
    return path_or_reader


def _field_value(field) -> Any:
    """Decode one ``ReaderField`` into a Python value (str/int/float/bool or a list)."""
    from gguf import GGUFValueType

    types = field.types
    if not types:
        return None

    def scalar(part, vtype):
        if vtype == GGUFValueType.STRING:
            return bytes(part).decode("utf-8")
        value = part[0].item()
        if vtype == GGUFValueType.BOOL:
            return bool(value)
        return value

    if types[0] == GGUFValueType.ARRAY:
        sub = types[-1]
        if sub == GGUFValueType.ARRAY:  # nested arrays: rare, return raw parts
            return [field.parts[i].tolist() for i in field.data]
        return [scalar(field.parts[i], sub) for i in field.data]
    return scalar(field.parts[field.data[0]], types[0])


def read_gguf_metadata(path_or_reader, *, with_vocab: bool = False) -> dict[str, Any]:
    """All metadata key/values of a GGUF file as plain Python values.

    Unless ``with_vocab`` is true, the large tokenizer arrays are replaced by their
    length (an ``int``), which keeps this cheap.
    """
    reader = _as_reader(path_or_reader)
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        if not with_vocab and key in _VOCAB_KEYS:
            meta[key] = len(field.data)
        else:
            meta[key] = _field_value(field)
    return meta


def gguf_name_to_hf(name: str) -> str | None:
    """The Hugging Face parameter name of a GGUF tensor name.

    Returns ``None`` for tensors that are deliberately skipped; raises ``KeyError``
    for names this loader does not know.
    """
    if name in _SKIPPED_NAMES:
        return None
    base, _, suffix = name.rpartition(".")
    if base in _TOP_LEVEL_NAMES and suffix in ("weight", "bias"):
        return f"{_TOP_LEVEL_NAMES[base]}.{suffix}"
    m = _BLOCK_RE.match(name)
    if m and m.group(2) in _BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"
    raise KeyError(f"unknown GGUF tensor name {name!r}")


def _permute(w: torch.Tensor, n_head: int, inverse: bool) -> torch.Tensor:
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise ValueError(f"cannot (un)permute {tuple(w.shape)} for {n_head} heads")
    half = rows // n_head // 2
    rest = tuple(w.shape[1:])
    shape = (n_head, half, 2, *rest) if inverse else (n_head, 2, half, *rest)
    return w.reshape(shape).transpose(1, 2).reshape(w.shape).contiguous()


def permute_qk_to_gguf(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's Q/K permutation (HF rotate-half rows -> interleaved rows).

    ``n_head`` is the number of attention heads for Q and of KV heads for K.
    """
    return _permute(w, n_head, inverse=False)


def unpermute_qk_from_gguf(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of :func:`permute_qk_to_gguf` (GGUF interleaved rows -> HF rows)."""
    return _permute(w, n_head, inverse=True)


def _dequantize(tensor) -> np.ndarray:
    """Dequantize a ``ReaderTensor`` to a float32 array of the HF (row-major) shape."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    qtype = tensor.tensor_type
    hf_shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    if qtype in (
        GGMLQuantizationType.F64,
        GGMLQuantizationType.I8,
        GGMLQuantizationType.I16,
        GGMLQuantizationType.I32,
        GGMLQuantizationType.I64,
    ):
        arr = np.asarray(tensor.data).astype(np.float32)
    else:
        arr = dequantize(tensor.data, qtype)
    arr = arr.reshape(hf_shape)
    if arr.dtype != np.float32:
        arr = arr.astype(np.float32)
    if not arr.flags.writeable or not arr.flags.c_contiguous:
        # F32 tensors come back as views of the read-only memory map: copy them.
        arr = np.array(arr, dtype=np.float32, order="C", copy=True)
    return arr


def _architecture(meta: dict[str, Any]) -> str:
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise NotImplementedError(
            f"GGUF architecture {arch!r} is not supported (supported: {sorted(SUPPORTED_ARCHITECTURES)})"
        )
    return arch


def _iter_tensors(reader, meta: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    arch = _architecture(meta)
    permute = arch in _PERMUTED_QK_ARCHITECTURES
    n_head = int(meta[f"{arch}.attention.head_count"])
    n_kv_head = int(meta.get(f"{arch}.attention.head_count_kv", n_head))
    for tensor in reader.tensors:
        hf_name = gguf_name_to_hf(tensor.name)
        if hf_name is None:  # rope_freqs: in the config (build_hf_config)
            continue
        w = torch.from_numpy(_dequantize(tensor))
        if permute:
            if ".attn_q." in tensor.name:
                w = unpermute_qk_from_gguf(w, n_head)
            elif ".attn_k." in tensor.name:
                w = unpermute_qk_from_gguf(w, n_kv_head)
        yield hf_name, w
    # A Llama-style file with q/k/v biases and none on the output projection: the Hugging
    # Face config's attention_bias (build_hf_config) means all four, so the output gets
    # zeros, which change nothing.
    names = {t.name for t in reader.tensors}
    if arch in ("llama", "qwen3") and "blk.0.attn_q.bias" in names:
        hidden = int(meta[f"{arch}.embedding_length"])
        for i in range(int(meta[f"{arch}.block_count"])):
            if f"blk.{i}.attn_output.bias" not in names:
                yield f"model.layers.{i}.self_attn.o_proj.bias", torch.zeros(hidden)


def iter_gguf_tensors(path_or_reader) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, float32 tensor)`` for every weight of a GGUF file."""
    reader = _as_reader(path_or_reader)
    return _iter_tensors(reader, read_gguf_metadata(reader))


# --------------------------------------------------------------------------------------
# config
# --------------------------------------------------------------------------------------
def _rope_freqs(reader) -> np.ndarray | None:
    """The ``rope_freqs.weight`` tensor's values (one divisor per rotary frequency)."""
    t = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    return None if t is None else np.asarray(t.data, dtype=np.float64).reshape(-1)


def llama3_scaling_from_factors(factors: np.ndarray, theta: float, head_dim: int,
                                original_len: int = 8192) -> dict[str, Any]:
    """The ``llama3`` rope_scaling that llama.cpp's converter turned into ``factors``.

    Each frequency's inverse is divided by its factor: 1 for short wavelengths, ``factor``
    for long ones, and between them 1 / ((1 - s) / factor + s), where s is linear in
    1 / wavelength. The ramp's two ends (wavelengths original_len / high_freq_factor and
    original_len / low_freq_factor) follow from a line through those points; only their
    ratio to original_len is fixed by the factors, so original_len is the file's (or 8192,
    Llama 3's) and the frequency factors are solved for it."""
    factors = np.asarray(factors, dtype=np.float64)
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if factors.shape != inv_freq.shape:
        raise ValueError(f"GGUF rope_freqs has {factors.size} factors; the rotary embedding "
                         f"has {inv_freq.size} frequencies.")
    factor = float(factors.max())
    ramp = (factors > 1 + 1e-6) & (factors < factor * (1 - 1e-6))
    if factor <= 1 or ramp.sum() < 2:
        raise ValueError("GGUF rope_freqs is not Llama 3's RoPE scaling (a ramp between 1 "
                         "and a factor), which is the only kind this engine reads.")
    smooth = (1 / factors[ramp] - 1 / factor) / (1 - 1 / factor)
    slope, intercept = np.polyfit(inv_freq[ramp] / (2 * np.pi), smooth, 1)
    # smooth = (original_len / wavelength - low) / (high - low)
    low = -intercept * original_len / slope
    high = low + original_len / slope
    scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": float(low),
               "high_freq_factor": float(high), "original_max_position_embeddings": original_len}
    from .layers import rope_inverse_frequencies
    got = rope_inverse_frequencies(head_dim, theta, scaling).double().numpy()
    if not np.allclose(got, inv_freq / factors, rtol=1e-4):
        raise ValueError("GGUF rope_freqs is not Llama 3's RoPE scaling (a ramp between 1 "
                         "and a factor), which is the only kind this engine reads.")
    return scaling


def build_hf_config(metadata: dict[str, Any], tensor_names: Iterable[str],
                    rope_freqs: np.ndarray | None = None) -> dict[str, Any]:
    """A Hugging Face ``config.json`` dict from GGUF metadata, GGUF tensor names and the
    ``rope_freqs`` tensor's values, if the file has one."""
    arch = _architecture(metadata)
    model_type, arch_class = SUPPORTED_ARCHITECTURES[arch]
    names = set(tensor_names)

    def key(name: str, default: Any = None) -> Any:
        return metadata.get(f"{arch}.{name}", default)

    hidden = int(key("embedding_length"))
    n_head = int(key("attention.head_count"))
    n_kv = int(key("attention.head_count_kv", n_head))
    head_dim = int(key("attention.key_length", hidden // n_head))
    vocab = key("vocab_size")
    if vocab is None:
        tokens = metadata.get("tokenizer.ggml.tokens")
        vocab = tokens if isinstance(tokens, int) else len(tokens) if tokens is not None else None
    if vocab is None:
        raise ValueError("cannot determine vocab_size from the GGUF metadata")
    rope_theta = float(key("rope.freq_base", 10000.0))
    rope_params: dict[str, Any] = {"rope_theta": rope_theta, "rope_type": "default"}
    scaling_type = key("rope.scaling.type")
    if scaling_type not in (None, "none"):
        factor = key("rope.scaling.factor")
        if scaling_type == "linear" and factor is not None:
            rope_params.update(rope_type="linear", factor=float(factor))
        elif scaling_type == "yarn" and factor is not None:
            rope_params.update(rope_type="yarn", factor=float(factor))
            orig = key("rope.scaling.original_context_length")
            if orig is not None:
                rope_params["original_max_position_embeddings"] = int(orig)
        else:
            warnings.warn(f"unsupported GGUF rope scaling {scaling_type!r}; ignored", stacklevel=2)
    if rope_freqs is not None:
        rope_params.update(llama3_scaling_from_factors(
            rope_freqs, rope_theta, int(key("rope.dimension_count", head_dim)),
            int(key("rope.scaling.original_context_length", 8192))))
    rot_dims = key("rope.dimension_count")
    if rot_dims is not None and int(rot_dims) != head_dim:
        warnings.warn(f"partial rotary ({rot_dims} of {head_dim} head dims) is not represented", stacklevel=2)

    config: dict[str, Any] = {
        "architectures": [arch_class],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": rope_theta,
        "rope_parameters": rope_params,
        "max_position_embeddings": int(key("context_length", 2048)),
        "vocab_size": int(vocab),
        "tie_word_embeddings": "output.weight" not in names,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": "float32",
        "dtype": "float32",
    }
    if rope_params["rope_type"] != "default":
        config["rope_scaling"] = dict(rope_params)
    if model_type in ("llama", "qwen3"):  # Qwen2 always has q/k/v biases, no flag
        config["attention_bias"] = "blk.0.attn_q.bias" in names
    if model_type == "llama":
        config["mlp_bias"] = False
    for hf_key, gguf_key in (
        ("bos_token_id", "tokenizer.ggml.bos_token_id"),
        ("eos_token_id", "tokenizer.ggml.eos_token_id"),
        ("pad_token_id", "tokenizer.ggml.padding_token_id"),
    ):
        if gguf_key in metadata:
            config[hf_key] = int(metadata[gguf_key])
    return config


def load_gguf_state(path: PathLike) -> tuple[dict[str, Any], Iterator[tuple[str, torch.Tensor]]]:
    """``(hf_config_dict, iterator of (hf_name, float32 tensor))`` for a GGUF file.

    The iterator dequantizes lazily, one tensor at a time.
    """
    reader = open_gguf(path)
    meta = read_gguf_metadata(reader)
    config = build_hf_config(meta, (t.name for t in reader.tensors), _rope_freqs(reader))
    return config, _iter_tensors(reader, meta)


# --------------------------------------------------------------------------------------
# conversion to a Hugging Face folder
# --------------------------------------------------------------------------------------
def _save_tokenizer(gguf_path: Path, out_dir: Path, meta: dict[str, Any]) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    if meta.get("tokenizer.ggml.pre") == "smollm":
        # SmolLM's own tokenizer (and llama.cpp's "smollm" pre-tokenizer) splits every
        # digit on its own before the GPT-2 byte-level split; transformers' GGUF
        # tokenizer only does the latter. The ids are the same either way (the
        # vocabulary has no merges involving digits) but offsets differ, so restore it.
        from tokenizers import pre_tokenizers

        tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
            ]
        )
    template = meta.get("tokenizer.chat_template")
    if template and not getattr(tok, "chat_template", None):
        tok.chat_template = template
    try:
        tok.save_pretrained(str(out_dir), save_jinja_files=False)
    except TypeError:  # older transformers without the flag
        tok.save_pretrained(str(out_dir))
    # Tidy tokenizer_config.json: it must hold the chat template itself (some consumers
    # only read this file), and loader-only keys should not be persisted.
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
    for junk in ("is_local", "local_files_only", "name_or_path", "gguf_file"):
        cfg.pop(junk, None)
    if template:
        cfg["chat_template"] = template
    ctx = meta.get(f"{meta.get('general.architecture')}.context_length")
    if ctx:
        cfg["model_max_length"] = int(ctx)
    cfg.setdefault("clean_up_tokenization_spaces", False)
    for flag in ("add_bos_token", "add_eos_token"):
        if f"tokenizer.ggml.{flag}" in meta:
            cfg[flag] = bool(meta[f"tokenizer.ggml.{flag}"])
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    jinja = out_dir / "chat_template.jinja"
    if jinja.exists() and template:
        jinja.unlink()  # one source of truth: tokenizer_config.json


def _chmod_default(path: Path) -> None:
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def convert_gguf_to_hf_dir(gguf_path: PathLike, out_dir: PathLike, *, tokenizer: bool = True) -> Path:
    """Convert a GGUF file into a Hugging Face-style model folder (float32 safetensors).

    Writes into ``out_dir`` (created if needed) directly; callers wanting atomicity
    should pass a temporary folder and rename it afterwards.
    """
    from safetensors.torch import save_file

    gguf_path = Path(gguf_path)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    reader = open_gguf(gguf_path)
    meta = read_gguf_metadata(reader)
    config = build_hf_config(meta, (t.name for t in reader.tensors), _rope_freqs(reader))

    state: dict[str, torch.Tensor] = {}
    for name, tensor in _iter_tensors(reader, meta):
        if name == "lm_head.weight" and config["tie_word_embeddings"]:
            continue
        state[name] = tensor
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    _chmod_default(out / "model.safetensors")  # safetensors creates it 0600
    del state

    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    gen: dict[str, Any] = {"_from_model_config": True}
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if k in config:
            gen[k] = config[k]
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")

    if tokenizer and "tokenizer.ggml.model" in meta:
        _save_tokenizer(gguf_path, out, meta)
    return out
