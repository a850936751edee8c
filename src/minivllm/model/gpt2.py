"""GPT-2 over a flat batch of tokens: learned absolute positions, LayerNorm with bias,
GELU (tanh approximation), biases on every projection, the head tied to the token
embeddings. Its checkpoints store the projections as Conv1D, [in, out]: transposed at
load into the [out, in] of a Linear."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from ..config import ModelConfig
from .attention import AttentionMetadata, PagedAttention
from .layers import Linear, NamedTensors, activation
from .llama import KVCache

_CONV1D = (".c_attn.weight", ".c_proj.weight", ".c_fc.weight")
_NOT_WEIGHTS = (".attn.bias", ".attn.masked_bias")  # old checkpoints' causal-mask buffers


class GPT2Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: str) -> None:
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.c_attn = Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.c_proj = Linear(cfg.hidden_size, cfg.hidden_size)
        self.attn = PagedAttention(cfg.num_heads, cfg.num_heads, cfg.head_dim, backend,
                                   scale=cfg.attn_scale)

    def forward(self, x: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.c_attn(x).view(-1, 3, self.num_heads, self.head_dim).unbind(1)
        out = self.attn(q, k, v, kv_cache, meta)
        return self.c_proj(out.reshape(-1, self.num_heads * self.head_dim))


class GPT2MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.c_fc = Linear(cfg.hidden_size, cfg.intermediate_size)
        self.c_proj = Linear(cfg.intermediate_size, cfg.hidden_size)
        self.act = activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Block(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: str) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.attn = GPT2Attention(cfg, backend)
        self.ln_2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.mlp = GPT2MLP(cfg)

    def forward(self, x: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), kv_cache, meta)
        return x + self.mlp(self.ln_2(x))


class GPT2Model(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: str) -> None:
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.wpe = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.h = nn.ModuleList(GPT2Block(cfg, backend) for _ in range(cfg.num_layers))
        self.ln_f = nn.LayerNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], meta: AttentionMetadata) -> torch.Tensor:
        x = self.wte(input_ids) + self.wpe(positions)
        for block, kv_cache in zip(self.h, kv_caches):
            x = block(x, kv_cache, meta)
        return self.ln_f(x)


class GPT2LMHeadModel(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int, backend: str = "torch",
                 fused_ops: bool = False) -> None:
        super().__init__()
        if max_positions > cfg.max_position_embeddings:
            raise ValueError(f"GPT-2 has learned positions for {cfg.max_position_embeddings} "
                             f"tokens: max_model_len must be at most that, not {max_positions}.")
        self.config = cfg
        self.transformer = GPT2Model(cfg, backend)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # always tied

    @property
    def model(self) -> nn.Module:
        """The decoder stack (the name the engine's other families use)."""
        return self.transformer

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], meta: AttentionMetadata) -> torch.Tensor:
        return self.transformer(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor,
                       out: torch.Tensor | None = None) -> torch.Tensor:
        if out is None:
            return self.lm_head(hidden)
        return torch.mm(hidden, self.lm_head.weight.t(), out=out)

    def input_embeddings(self) -> nn.Embedding:
        return self.transformer.wte

    def decode_prelude_linear(self) -> nn.Module:
        return self.transformer.h[0].mlp.c_proj

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]],
                     packed=None) -> set[str]:
        if packed is not None:
            raise ValueError("Quantized GPT-2 checkpoints are not supported.")
        params = NamedTensors(self)
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.endswith(_NOT_WEIGHTS) or name == "lm_head.weight":
                continue
            target = name if name.startswith("transformer.") else f"transformer.{name}"
            if target not in params:
                raise ValueError(f"Checkpoint tensor {name!r} has no place in the model.")
            if target.endswith(_CONV1D):
                tensor = tensor.t()
            param = params[target]
            if param.shape != tensor.shape:
                raise ValueError(f"Shape mismatch for {name}: checkpoint "
                                 f"{tuple(tensor.shape)} vs model {tuple(param.shape)}.")
            param.data.copy_(tensor)
            loaded.add(target)
        return loaded

    @staticmethod
    def parameter_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
        h, inner = cfg.hidden_size, cfg.intermediate_size
        shapes = {"transformer.wte.weight": (cfg.vocab_size, h),
                  "transformer.wpe.weight": (cfg.max_position_embeddings, h)}
        for i in range(cfg.num_layers):
            p = f"transformer.h.{i}."
            shapes.update({
                p + "ln_1.weight": (h,), p + "ln_1.bias": (h,),
                p + "attn.c_attn.weight": (h, 3 * h), p + "attn.c_attn.bias": (3 * h,),
                p + "attn.c_proj.weight": (h, h), p + "attn.c_proj.bias": (h,),
                p + "ln_2.weight": (h,), p + "ln_2.bias": (h,),
                p + "mlp.c_fc.weight": (h, inner), p + "mlp.c_fc.bias": (inner,),
                p + "mlp.c_proj.weight": (inner, h), p + "mlp.c_proj.bias": (h,)})
        shapes.update({"transformer.ln_f.weight": (h,), "transformer.ln_f.bias": (h,)})
        return shapes
