"""What a model is and what it needs, from its config alone (`minivllm inspect`): its
family and shape, its parameters and their bytes in each storage format, its KV cache's
bytes per token, and how many tokens and sequences fit in a given amount of memory."""

from __future__ import annotations

import math

# Bytes per parameter of the decoder's projections in each format, as quantized at load
# (int4: 4 bits plus an fp32 scale and a uint8 zero point per group of 128).
FORMAT_BYTES = {"bf16": 2.0, "fp8": 1.0, "int8": 1.0, "int4": 0.5 + 5 / 128}


def _is_projection(name: str) -> bool:
    return name.endswith(("_proj.weight", "c_attn.weight", "c_proj.weight", "c_fc.weight"))


def _is_expert(name: str) -> bool:
    return ".experts." in name


def model_info(model: str, gpu_memory_gb: float | None = None,
               max_model_len: int | None = None, kv_dtype: str = "bf16") -> dict:
    """The facts `minivllm inspect` prints (a JSON-friendly dict). "fits": what is left
    of gpu_memory_gb after the weights, in KV-cache tokens (activations not counted)."""
    from .engine.llm_engine import read_model_config
    from .model.loader import hf_parameter_shapes

    _, config_path, cfg = read_model_config(model)
    shapes = hf_parameter_shapes(cfg)
    total = sum(math.prod(s) for s in shapes.values())
    projections = sum(math.prod(s) for n, s in shapes.items()
                      if _is_projection(n) and not _is_expert(n))
    experts = sum(math.prod(s) for n, s in shapes.items() if _is_expert(n))
    rest = total - projections - experts
    formats = {"bf16": 2.0} if cfg.family == "gpt2" else FORMAT_BYTES  # GPT-2: not quantized
    by_format = {fmt: (projections + experts) * b + rest * 2 for fmt, b in formats.items()}
    kv_elem = {"bf16": 2, "fp16": 2, "fp8": 1, "fp32": 4}[kv_dtype]
    import torch
    kv_token = cfg.kv_bytes_per_token({1: torch.float8_e4m3fn, 2: torch.bfloat16,
                                       4: torch.float32}[kv_elem])
    info = {
        "config": str(config_path), "architecture": cfg.architecture, "family": cfg.family,
        "layers": cfg.num_layers, "hidden_size": cfg.hidden_size, "heads": cfg.num_heads,
        "kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_position_embeddings,
        "sliding_windows": sorted({w for w in cfg.layer_windows if w is not None}),
        "parameters": total, "projection_parameters": projections + experts,
        "weight_bytes": by_format, "kv_bytes_per_token": kv_token, "kv_dtype": kv_dtype,
    }
    if cfg.moe:
        info["experts"] = {"num_experts": cfg.moe["num_experts"], "top_k": cfg.moe["top_k"],
                           "sparse_layers": sum(cfg.moe["sparse_layers"])}
    if gpu_memory_gb is not None:
        context = max_model_len or cfg.max_position_embeddings
        fits = {}
        for fmt, weights in by_format.items():
            left = gpu_memory_gb * 1e9 - weights
            tokens = max(0, int(left // kv_token)) if left > 0 else 0
            fits[fmt] = {"kv_tokens": tokens, "sequences_at_max_len": tokens // context}
        info["fits"] = {"memory_gb": gpu_memory_gb, "max_model_len": context, **fits}
    return info


def format_info(info: dict) -> str:
    """`minivllm inspect`'s text."""
    gb = 1e9
    lines = [f"{info['architecture']} ({info['family']}): {info['layers']} layers, hidden "
             f"{info['hidden_size']}, {info['heads']} heads ({info['kv_heads']} KV) x "
             f"{info['head_dim']}, vocabulary {info['vocab_size']:,}",
             f"parameters: {info['parameters'] / 1e9:.3f} B ({info['projection_parameters'] / 1e9:.3f}"
             " B in the projections)"]
    if "experts" in info:
        e = info["experts"]
        lines.append(f"experts: {e['num_experts']}, top-{e['top_k']}, in {e['sparse_layers']}"
                     " layers")
    if info["sliding_windows"]:
        lines.append(f"sliding windows: {info['sliding_windows']}")
    lines.append("weights: " + ", ".join(f"{fmt} {b / gb:.2f} GB"
                                         for fmt, b in info["weight_bytes"].items()))
    lines.append(f"KV cache: {info['kv_bytes_per_token'] / 1024:.1f} KiB per token "
                 f"({info['kv_dtype']})")
    if "fits" in info:
        f = info["fits"]
        lines.append(f"in {f['memory_gb']:g} GB, at max_model_len {f['max_model_len']:,}:")
        for fmt in info["weight_bytes"]:
            lines.append(f"  {fmt:5s} {f[fmt]['kv_tokens']:>12,} KV tokens, "
                         f"{f[fmt]['sequences_at_max_len']:,} full-length sequences")
    return "\n".join(lines)
