"""Builds a model and fills its weights from safetensors, a GGUF file, or dummy values."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import torch

from ..config import ModelConfig
from .layers import RotaryEmbedding
from .llama import MODEL_CLASSES
from .quantization import quantize_model


def hf_parameter_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Hugging Face parameter names and shapes of a checkpoint for this config."""
    h, d = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (cfg.intermediate_size, h),
            p + "mlp.up_proj.weight": (cfg.intermediate_size, h),
            p + "mlp.down_proj.weight": (h, cfg.intermediate_size),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        })
        if cfg.qkv_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)})
        if cfg.qk_norm:
            shapes.update({p + "self_attn.q_norm.weight": (d,),
                           p + "self_attn.k_norm.weight": (d,)})
    shapes["model.norm.weight"] = (h,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    return shapes


def weight_bytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """The weights' size in memory, from the checkpoint's shapes."""
    elem = torch.empty((), dtype=dtype).element_size()
    return sum(math.prod(shape) for shape in hf_parameter_shapes(cfg).values()) * elem


def dummy_weights(cfg: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32,
                  device: str | torch.device = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """Random weights from the config alone (as vLLM's load_format="dummy").

    Normal(0, initializer_range) for matrices and biases, ones for norms: the logits then
    have a realistic spread, so greedy decoding has clear winners and is comparable across
    engines that load the same tensors.
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, shape in hf_parameter_shapes(cfg).items():
        if name.endswith("norm.weight"):
            t = torch.ones(shape, dtype=torch.float32, device=device)
        else:
            t = torch.empty(shape, dtype=torch.float32, device=device)
            t.normal_(0.0, cfg.initializer_range, generator=gen)
        yield name, t.to(dtype)


def safetensors_weights(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"No *.safetensors files in {model_dir}.")
    for fname in files:
        with safe_open(str(model_dir / fname), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _weights_for(cfg: ModelConfig, model_path: Path, load_format: str, seed: int,
                 device: torch.device, dtype: torch.dtype):
    if load_format == "dummy":
        return dummy_weights(cfg, seed, dtype, device)
    if load_format == "gguf" or (load_format == "auto" and model_path.suffix == ".gguf"):
        from .gguf_loader import load_gguf_state
        _, tensors = load_gguf_state(model_path)
        return tensors
    model_dir = model_path if model_path.is_dir() else model_path.parent
    return safetensors_weights(model_dir)


def load_model(cfg: ModelConfig, model_path: Path, *, load_format: str, dtype: torch.dtype,
               device: torch.device, max_positions: int, attention_backend: str,
               fused_ops: bool = False, seed: int = 0,
               quantization: str | None = None) -> torch.nn.Module:
    """The model with its weights, its decoder projections quantized if asked
    (model/quantization.py: loaded in `dtype`, then quantized one projection at a time)."""
    check_prequantized(cfg)
    model_cls = MODEL_CLASSES[cfg.architecture]
    # Build on the meta device (no wasted random init), then materialize on the target.
    with torch.device("meta"):
        model = model_cls(cfg, max_positions, attention_backend, fused_ops)
    model = model.to_empty(device=device).to(dtype)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.reset_tables(device)
    expected = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    if cfg.tie_word_embeddings:
        expected.discard("lm_head.weight")
    with torch.no_grad():
        loaded = model.load_weights(_weights_for(cfg, model_path, load_format, seed, device, dtype))
    missing = expected - loaded
    if missing:
        raise ValueError(f"Checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}.")
    if quantization is not None:
        with torch.no_grad():
            quantize_model(model, quantization)
    return model.eval()


def check_prequantized(cfg: ModelConfig) -> None:
    """A checkpoint that is already quantized (config.json's quantization_config) cannot be
    read as full-precision weights: say so instead of failing on its tensor names."""
    qc = cfg.raw.get("quantization_config")
    if qc:
        method = qc.get("quant_method", "?") if isinstance(qc, dict) else "?"
        raise ValueError(f"This checkpoint is quantized ({method!r}); minivllm reads "
                         "full-precision checkpoints and quantizes them at load "
                         "(quantization='fp8', 'int8' or 'int4').")
