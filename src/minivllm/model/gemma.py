"""Gemma 1, 2 and 3 (text) over a flat batch of tokens: one class, switches from the config.

Beside Llama: embeddings scaled by sqrt(hidden); RMSNorm with (1 + weight), applied in fp32;
GeGLU (tanh GELU) MLP; the head tied to the embeddings. Gemma 2 adds norms after attention
and after the MLP, soft-caps the attention scores and the final logits (cap * tanh(x /
cap)), scales the queries by query_pre_attn_scalar instead of head_dim, and alternates
sliding-window and global layers. Gemma 3 normalizes q and k per head, has 5 local layers
to 1 global one, and gives the local layers a rotary base of their own.

The norms here run as PyTorch ops (the fused RMSNorm kernels take weight, not 1 + weight);
the attention is llama.DecoderAttention, every family's.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from .attention import AttentionMetadata
from .layers import GatedMLP, GemmaRMSNorm, RotaryEmbedding
from .llama import DecoderAttention, KVCache, LlamaForCausalLM, effective_windows


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, backend: str,
                 window: int | None) -> None:
        super().__init__()
        eps = cfg.rms_norm_eps
        # Unfused: the fused q/k norm kernel takes weight, not Gemma's 1 + weight.
        self.self_attn = DecoderAttention(cfg, rotary, backend, fused_ops=False, window=window,
                                          norm=GemmaRMSNorm)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, act=cfg.hidden_act)
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        # Gemma 2 and 3: norms on the attention's and the MLP's outputs too.
        self.sandwich = cfg.family != "gemma"
        if self.sandwich:
            self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
            self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x), positions, kv_cache, meta)
        if not self.sandwich:  # Gemma: post_attention_layernorm is the MLP's input norm
            x = x + h
            return x + self.mlp(self.post_attention_layernorm(x))
        x = x + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(x))
        return x + self.post_feedforward_layernorm(h)


class GemmaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int, backend: str) -> None:
        super().__init__()
        self.hidden_size = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling,
                                 cfg.max_position_embeddings)
        local = rotary
        if cfg.rope_local is not None:  # Gemma 3's sliding layers
            local = RotaryEmbedding(cfg.head_dim, max_positions, *cfg.rope_local)
        windows = effective_windows(cfg, max_positions)
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(cfg, local if cfg.layer_windows[i] is not None else rotary,
                              backend, windows[i])
            for i in range(cfg.num_layers))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        # transformers scales in the embeddings' dtype.
        x = x * torch.tensor(self.hidden_size ** 0.5, dtype=x.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(x, positions, kv_cache, meta)
        return self.norm(x)


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma / Gemma 2 / Gemma 3 causal LM (Llama's weight loading: the same names)."""

    def __init__(self, cfg: ModelConfig, max_positions: int, backend: str = "torch",
                 fused_ops: bool = False) -> None:
        nn.Module.__init__(self)
        self.config = cfg
        self.model = GemmaModel(cfg, max_positions, backend)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def compute_logits(self, hidden: torch.Tensor,
                       out: torch.Tensor | None = None) -> torch.Tensor:
        cap = self.config.final_softcap
        if cap is None:
            return super().compute_logits(hidden, out)
        logits = torch.tanh(super().compute_logits(hidden) / cap) * cap
        return logits if out is None else out.copy_(logits)

    @staticmethod
    def parameter_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
        shapes = LlamaForCausalLM.parameter_shapes(cfg)
        if cfg.family != "gemma":
            for i in range(cfg.num_layers):
                for norm in ("pre_feedforward_layernorm", "post_feedforward_layernorm"):
                    shapes[f"model.layers.{i}.{norm}.weight"] = (cfg.hidden_size,)
        return shapes
