"""What each supported architecture's config.json means: the family it belongs to, the
settings its fields give the model code, and which fields are used or knowingly ignored.

A field that changes the computation is either read here or refused with the reason; a
test (tests/test_model_families.py) reads each family's transformers config and fails on
a field that is in neither list, so a new transformers field is looked at, not silently
dropped (Mistral's `sliding_window` once was: its models loaded as Llama and gave other
tokens than transformers past the window).
"""

from __future__ import annotations

import math

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
    "GemmaForCausalLM": "gemma",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "GPT2LMHeadModel": "gpt2",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
               "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
               "phi3": "Phi3ForCausalLM", "gemma": "GemmaForCausalLM",
               "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
               "gpt2": "GPT2LMHeadModel", "mixtral": "MixtralForCausalLM",
               "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}

# Fields of every family that do not change inference: training-only settings, output
# switches of transformers' modules, labels, bookkeeping.
COMMON_IGNORED = {
    "_name_or_path", "transformers_version", "chunk_size_feed_forward", "id2label",
    "label2id", "is_encoder_decoder", "output_attentions", "output_hidden_states",
    "problem_type", "return_dict", "use_cache", "pad_token_id", "attention_dropout",
    "dtype", "torch_dtype", "model_type", "architectures", "tie_word_embeddings",
    "bos_token_id", "eos_token_id", "initializer_range", "max_position_embeddings",
    "embd_pdrop", "resid_pdrop", "attn_pdrop", "summary_activation", "summary_first_dropout",
    "summary_proj_to_labels", "summary_type", "summary_use_proj",  # GPT-2's unused heads
    "quantization_config",  # model/prequantized.py reads it
    "_note",  # bench/model_configs' remarks on a dummy-weight config
    # Mixtures of experts: training's router losses and noise, and the router's logits as
    # an output.
    "output_router_logits", "router_aux_loss_coef", "router_jitter_noise",
}
_LLAMA_USED = {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
               "rope_parameters", "rope_theta", "rope_scaling", "hidden_act"}
USED = {
    "llama": _LLAMA_USED | {"attention_bias", "mlp_bias"},
    "mistral": _LLAMA_USED | {"sliding_window"},
    "qwen2": _LLAMA_USED | {"sliding_window", "use_sliding_window", "max_window_layers",
                            "layer_types"},
    "qwen3": _LLAMA_USED | {"attention_bias", "sliding_window", "use_sliding_window",
                            "max_window_layers", "layer_types"},
    "phi3": _LLAMA_USED | {"sliding_window", "original_max_position_embeddings",
                           "partial_rotary_factor"},
    "gemma": _LLAMA_USED | {"attention_bias", "hidden_activation",
                            "use_bidirectional_attention"},
    "gemma2": _LLAMA_USED | {"attention_bias", "hidden_activation", "attn_logit_softcapping",
                             "final_logit_softcapping", "query_pre_attn_scalar",
                             "sliding_window", "layer_types", "use_bidirectional_attention"},
    "gemma3": _LLAMA_USED | {"attention_bias", "hidden_activation", "attn_logit_softcapping",
                             "final_logit_softcapping", "query_pre_attn_scalar",
                             "sliding_window", "layer_types", "_sliding_window_pattern",
                             "sliding_window_pattern", "rope_local_base_freq",
                             "use_bidirectional_attention"},
    "mixtral": _LLAMA_USED | {"sliding_window", "num_local_experts", "num_experts_per_tok"},
    "qwen2_moe": _LLAMA_USED | {"sliding_window", "use_sliding_window", "max_window_layers",
                                "layer_types", "qkv_bias", "num_experts", "num_experts_per_tok",
                                "moe_intermediate_size", "shared_expert_intermediate_size",
                                "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers"},
    "qwen3_moe": _LLAMA_USED | {"attention_bias", "sliding_window", "use_sliding_window",
                                "num_experts", "num_local_experts", "num_experts_per_tok",
                                "moe_intermediate_size", "norm_topk_prob",
                                "decoder_sparse_step", "mlp_only_layers"},
    "gpt2": {"vocab_size", "n_embd", "n_head", "n_layer", "n_inner", "n_positions",
             "n_ctx", "activation_function", "layer_norm_epsilon", "scale_attn_weights",
             "scale_attn_by_inverse_layer_idx", "add_cross_attention"},
}
# Fields transformers reads that give the same result here, each with the reason.
IGNORED = {
    "llama": {"pretraining_tp": "a training-time split of the same matmuls"},
    "gpt2": {"reorder_and_upcast_attn": "the same attention, in fp32 either way on the CPU"},
}


def unread_fields(family: str, cfg: dict) -> list[str]:
    """The config's fields this engine neither reads nor knows to be harmless: a newer
    transformers' setting, or a checkpoint's own, that may change the result."""
    return sorted(set(cfg) - USED[family] - set(IGNORED.get(family, {})) - COMMON_IGNORED)


def _rope(cfg: dict, section: str | None = None) -> tuple[float, dict | None]:
    """(theta, scaling) from rope_parameters (transformers 5; per layer type for Gemma 3)
    or the older rope_theta / rope_scaling fields."""
    params = dict(cfg.get("rope_parameters") or {})
    if section is not None and section in params:
        params = dict(params[section] or {})
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    scaling = cfg.get("rope_scaling") or (
        params if params.get("rope_type", params.get("type", "default")) != "default"
        else None)
    if scaling is not None:
        scaling = dict(scaling)
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind not in ("default", "llama3", "linear", "longrope"):
            raise ValueError(f"Unsupported rope scaling type {kind!r}.")
        if kind == "default":
            scaling = None
        else:
            scaling["rope_type"] = kind
    return float(theta), scaling


def _windows_by_type(cfg: dict, n: int, default_pattern: int | None) -> list[int | None]:
    """Per layer: its sliding window, None for a global layer (layer_types, else Gemma's
    pattern: every `default_pattern`-th layer global)."""
    window = cfg.get("sliding_window")
    types = cfg.get("layer_types")
    if types is None and default_pattern is not None:
        pattern = cfg.get("sliding_window_pattern", cfg.get("_sliding_window_pattern",
                                                            default_pattern))
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                 for i in range(n)]
    if types is None:
        return [window] * n
    if len(types) != n:
        raise ValueError(f"layer_types has {len(types)} entries for {n} layers.")
    for t in types:
        if t not in ("sliding_attention", "full_attention"):
            raise ValueError(f"Unsupported layer type {t!r}.")
    return [window if t == "sliding_attention" else None for t in types]


def family_settings(family: str, cfg: dict) -> dict:
    """ModelConfig's fields that depend on the family (see ModelConfig)."""
    n = cfg.get("num_hidden_layers", cfg.get("n_layer"))
    # transformers reads attention_bias (q/k/v and o) in these families only; Qwen2's q/k/v
    # always have a bias, Mistral's, Phi-3's and Mixtral's never.
    attention_bias = (family in ("llama", "qwen3", "qwen3_moe", "gemma", "gemma2", "gemma3")
                      and bool(cfg.get("attention_bias", False)))
    out: dict = {"attn_softcap": None, "final_softcap": None, "attn_scale": None,
                 "rope_local": None, "hidden_act": cfg.get("hidden_act", "silu"),
                 "qkv_bias": (family in ("qwen2", "gpt2") or attention_bias
                              or (family == "qwen2_moe" and cfg.get("qkv_bias", True))),
                 "o_bias": attention_bias,
                 "qk_norm": family in ("qwen3", "gemma3", "qwen3_moe"),
                 "tie_word_embeddings": bool(cfg.get(
                     "tie_word_embeddings", family in ("gemma", "gemma2", "gemma3", "gpt2")))}
    if family == "gpt2":
        if cfg.get("add_cross_attention"):
            raise ValueError("GPT-2 with cross-attention (an encoder-decoder) is not "
                             "supported.")
        if cfg.get("scale_attn_by_inverse_layer_idx"):
            raise ValueError("GPT-2's scale_attn_by_inverse_layer_idx is not supported.")
        if cfg.get("scale_attn_weights", True) is False:
            out["attn_scale"] = 1.0
        out["hidden_act"] = cfg.get("activation_function", "gelu_new")
        out["layer_windows"] = [None] * n
        return out
    windows = [None] * n
    if family in ("mixtral", "qwen2_moe", "qwen3_moe"):
        out["moe"] = _moe_settings(family, cfg, n)
    if family in ("mistral", "phi3", "mixtral"):
        windows = [cfg.get("sliding_window")] * n
    elif family in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
        if cfg.get("use_sliding_window"):
            raise ValueError(f"{family} with use_sliding_window is not supported (its "
                             "released models do not use it).")
    elif family == "gemma":
        if cfg.get("use_bidirectional_attention"):
            raise ValueError("Gemma with use_bidirectional_attention (an encoder) is not "
                             "supported.")
        out["hidden_act"] = cfg.get("hidden_activation") or "gelu_pytorch_tanh"
    elif family in ("gemma2", "gemma3"):
        if cfg.get("use_bidirectional_attention"):
            raise ValueError("Gemma with use_bidirectional_attention (an encoder) is not "
                             "supported.")
        windows = _windows_by_type(cfg, n, 2 if family == "gemma2" else 6)
        out["hidden_act"] = cfg.get("hidden_activation") or "gelu_pytorch_tanh"
        out["attn_softcap"] = cfg.get("attn_logit_softcapping")
        out["final_softcap"] = cfg.get("final_logit_softcapping")
        out["attn_scale"] = cfg.get("query_pre_attn_scalar", 256) ** -0.5
        if family == "gemma3":
            local = dict((cfg.get("rope_parameters") or {}).get("sliding_attention") or {})
            theta = local.get("rope_theta", cfg.get("rope_local_base_freq", 10000.0))
            out["rope_local"] = (float(theta), None)
    if family == "phi3":
        params = dict(cfg.get("rope_parameters") or {})
        partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
        if partial != 1.0:
            raise ValueError(f"Phi-3 with partial_rotary_factor {partial} is not supported.")
    if cfg.get("mlp_bias"):
        raise ValueError("mlp_bias is not supported.")
    out["layer_windows"] = windows
    if out["hidden_act"] not in ("silu", "gelu_pytorch_tanh", "gelu_new", "gelu"):
        raise ValueError(f"Unsupported activation {out['hidden_act']!r}.")
    return out


def _moe_settings(family: str, cfg: dict, n: int) -> dict:
    """The mixture of experts: E experts, top-k of the router's softmax, renormalized
    (Mixtral always; Qwen with norm_topk_prob), an always-on shared expert with a sigmoid
    gate (Qwen2-MoE), and which layers are sparse (Qwen: every decoder_sparse_step-th but
    mlp_only_layers; the others have a dense MLP of intermediate_size)."""
    experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    if not experts or experts < 1:
        raise ValueError(f"{family}: num_experts must be at least 1.")
    k = cfg.get("num_experts_per_tok", 2)
    if not 1 <= k <= experts:
        raise ValueError(f"{family}: num_experts_per_tok must be in 1..{experts}, got {k}.")
    if family == "mixtral":
        sparse = [True] * n
        size, renormalize, shared = cfg["intermediate_size"], True, 0
    else:
        step = cfg.get("decoder_sparse_step", 1) or 1
        dense = set(cfg.get("mlp_only_layers") or [])
        sparse = [i not in dense and (i + 1) % step == 0 for i in range(n)]
        size = cfg.get("moe_intermediate_size", cfg["intermediate_size"])
        renormalize = bool(cfg.get("norm_topk_prob", False))
        shared = cfg.get("shared_expert_intermediate_size", 0) if family == "qwen2_moe" else 0
    return {"num_experts": experts, "top_k": k, "intermediate_size": size,
            "renormalize": renormalize, "shared_intermediate_size": shared,
            "sparse_layers": tuple(sparse)}


def longrope_tables(head_dim: int, theta: float, scaling: dict,
                    max_position_embeddings: int) -> tuple:
    """(short inv_freq, long inv_freq, original max positions, attention factor): Phi-3's
    LongRoPE. Positions below the original maximum use the short factors, the rest the
    long ones (vLLM's reading; transformers switches a whole forward by its longest
    position, which differs only for a forward that spans the boundary)."""
    import torch
    original = scaling.get("original_max_position_embeddings") or max_position_embeddings
    factor = scaling.get("factor") or max_position_embeddings / original
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor)
                                                        / math.log(original))
    shape = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    short = 1.0 / (torch.tensor(scaling["short_factor"], dtype=torch.float32) * theta ** shape)
    long = 1.0 / (torch.tensor(scaling["long_factor"], dtype=torch.float32) * theta ** shape)
    return short, long, original, float(attention)
