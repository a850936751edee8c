"""Llama-family decoder over a flat batch of tokens: Llama, Mistral, Qwen2, Qwen3, Phi-3.

They differ only in switches read from the config: Qwen2 adds a bias to the q/k/v
projections, Qwen3 normalizes q and k per head (RMSNorm) before the rotary embedding,
Llama 3.x scales its rotary frequencies, Phi-3 scales them by LongRoPE and stores q/k/v
and gate/up already fused, Mistral (and Phi-3) may attend within a sliding window. One
class covers them all.

Input is one flat token batch (several sequences concatenated) with explicit positions
and AttentionMetadata; there is no padding and no batch dimension.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from torch import nn

import csrc_triton

from ..config import ModelConfig
from .attention import AttentionMetadata, PagedAttention
from .layers import GatedMLP, Linear, NamedTensors, RMSNorm, RotaryEmbedding
from .moe import MoE
from .prequantized import PackedParts
from .quantization import Fp8Activations, fp8_activations_for

logger = logging.getLogger(__name__)


def _is_kv_cache_scale(name: str) -> bool:
    """A checkpoint's calibrated KV-cache scale (compressed-tensors' self_attn.k_scale /
    v_scale, AutoFP8's k_proj / v_proj output_scale)."""
    module, _, leaf = name.rpartition(".")
    return leaf in ("k_scale", "v_scale", "q_scale", "prob_scale", "kv_scale") or (
        leaf == "output_scale" and module.rpartition(".")[2] in ("k_proj", "v_proj"))

KVCache = tuple[torch.Tensor, torch.Tensor]


def effective_windows(cfg: ModelConfig, max_positions: int) -> list[int | None]:
    """Per layer, the sliding window that can matter: none where it spans every position
    the engine runs (max_model_len), as Phi-3.5's 262,144 does."""
    windows = cfg.layer_windows or (None,) * cfg.num_layers
    return [w if w is not None and w < max_positions else None for w in windows]


class DecoderAttention(nn.Module):
    """Every family's attention but GPT-2's: fused q/k/v, optional per-head q/k norm
    (Qwen3, Gemma 3: `norm` is the family's RMSNorm), rotary, paged attention (with
    Gemma 2's soft-cap and query scale where the config has them), o."""

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, backend: str,
                 fused_ops: bool, window: int | None = None,
                 norm: type[nn.Module] = RMSNorm) -> None:
        super().__init__()
        self.fused_ops = fused_ops
        self.eps = cfg.rms_norm_eps
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size,
                               bias=cfg.qkv_bias, fused_ops=fused_ops)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias,
                             fused_ops=fused_ops)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = norm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = norm(cfg.head_dim, cfg.rms_norm_eps)
        self.rotary = rotary
        self.attn = PagedAttention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, backend,
                                   window=window, softcap=cfg.attn_softcap,
                                   scale=cfg.attn_scale)

    def forward(self, x: torch.Tensor | Fp8Activations, positions: torch.Tensor,
                kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        w = self.qkv_proj.gemv_weight(x) if self.fused_ops and not self.qk_norm else None
        if w is not None:
            # Batch-1 decode: rotary and the K/V store as the q/k/v GEMV's epilogue.
            q = csrc_triton.gemv_rotary(
                x, w, positions, self.rotary.cos_table, self.rotary.sin_table, self.q_size,
                self.kv_size, kv_cache[0], kv_cache[1], meta.slot_mapping)
            out = self.attn.attend(q.view(-1, self.num_heads, self.head_dim), kv_cache, meta)
            return self.o_proj(out.reshape(-1, self.q_size))
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.fused_ops:
            # One kernel: q/k norm (Qwen3), rotary, and the K/V store into the cache.
            q, k = csrc_triton.rotary_embedding(
                positions, q, k, self.rotary.cos_table, self.rotary.sin_table,
                q_norm_weight=self.q_norm.weight if self.qk_norm else None,
                k_norm_weight=self.k_norm.weight if self.qk_norm else None, eps=self.eps,
                v=v, k_cache=kv_cache[0], v_cache=kv_cache[1], slot_mapping=meta.slot_mapping)
            out = self.attn.attend(q, kv_cache, meta)
        else:
            if self.qk_norm:
                q = self.q_norm(q)
                k = self.k_norm(k)
            q, k = self.rotary(positions, q, k)
            out = self.attn(q, k, v, kv_cache, meta)
        return self.o_proj(out.reshape(-1, self.q_size))


def add_and_norm(x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm,
                 fused_ops: bool, then: nn.Module | None = None
                 ) -> tuple[torch.Tensor | Fp8Activations, torch.Tensor]:
    """residual += x (x alone for the first layer), then normalize the residual. Returns
    (normed, residual). The fused kernel updates the residual in place, and when `then`
    (the projection the normed rows go to) multiplies them in W8A8, it writes them in e4m3
    with their scales (Fp8Activations)."""
    if fused_ops:
        fp8 = fp8_activations_for(then, x.shape[0], x.device)
        out, scale = (None, None) if fp8 is None else fp8
        if residual is None:
            normed = csrc_triton.rms_norm(x, norm.weight, norm.eps, out=out, scale_out=scale)
            residual = x
        else:
            normed, residual = csrc_triton.fused_add_rms_norm(
                x, residual, norm.weight, norm.eps, out=out, scale_out=scale)
        return (normed if fp8 is None else fp8), residual
    residual = x if residual is None else residual + x
    return norm(residual), residual


class DecoderLayer(nn.Module):
    """Carries the residual stream separately (vLLM's layout) so the residual add and
    the next norm can be one fused kernel: layer i adds its input to the residual."""

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, backend: str,
                 fused_ops: bool, window: int | None = None, sparse: bool = False) -> None:
        super().__init__()
        self.fused_ops = fused_ops
        self.self_attn = DecoderAttention(cfg, rotary, backend, fused_ops, window)
        if sparse:  # a mixture of experts (model/moe.py)
            self.mlp = MoE(cfg.hidden_size, cfg.moe, cfg.hidden_act, backend)
        else:
            self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, fused_ops)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                kv_cache: KVCache, meta: AttentionMetadata,
                ) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = add_and_norm(x, residual, self.input_layernorm, self.fused_ops,
                                   then=self.self_attn.qkv_proj)
        h = self.self_attn(h, positions, kv_cache, meta)
        h, residual = add_and_norm(h, residual, self.post_attention_layernorm, self.fused_ops,
                                   then=getattr(self.mlp, "gate_up_proj", None))
        return self.mlp(h), residual


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int, backend: str,
                 fused_ops: bool) -> None:
        super().__init__()
        self.fused_ops = fused_ops
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        # One rotary table shared by every layer.
        rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling,
                                 cfg.max_position_embeddings)
        windows = effective_windows(cfg, max_positions)
        sparse = cfg.moe["sparse_layers"] if cfg.moe else (False,) * cfg.num_layers
        self.layers = nn.ModuleList(DecoderLayer(cfg, rotary, backend, fused_ops, windows[i],
                                                 sparse[i])
                                    for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, positions, kv_cache, meta)
        return add_and_norm(x, residual, self.norm, self.fused_ops)[0]


class LlamaForCausalLM(nn.Module):
    """Llama / Mistral / Qwen2 / Qwen3 / Phi-3 causal LM. forward() returns hidden
    states; compute_logits() projects only the rows that are sampled."""

    def __init__(self, cfg: ModelConfig, max_positions: int, backend: str = "torch",
                 fused_ops: bool = False) -> None:
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg, max_positions, backend, fused_ops)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, meta)

    def input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def decode_prelude_linear(self) -> nn.Module:
        """A projection of the first layer (cuda_graph_runner.make_prelude's GEMM): its
        MLP's down projection (the o projection where the MLP is a mixture)."""
        layer = self.model.layers[0]
        return getattr(layer.mlp, "down_proj", None) or layer.self_attn.o_proj

    def compute_logits(self, hidden: torch.Tensor,
                       out: torch.Tensor | None = None) -> torch.Tensor:
        """The head's logits in the model's dtype, into `out` when given (a graph's output
        buffer: no copy after)."""
        if hidden.device.type == "cpu" and 1 < hidden.shape[0] <= 16:
            # A few rows (a verification, a small batch) on the CPU: MKL's sgemm for
            # hidden @ W^T re-packs the whole vocabulary's weights each call, W @ hidden^T
            # streams them: SmolLM2's head at 5 rows 39 -> 27 ms (docs/decisions.md).
            logits = (self.lm_head.weight @ hidden.t()).t()
            return logits.contiguous() if out is None else out.copy_(logits)
        if out is None:
            return self.lm_head(hidden)
        return torch.mm(hidden, self.lm_head.weight.t(), out=out)

    # ---- weights --------------------------------------------------------------------

    # Hugging Face name fragment -> (fused parameter fragment, shard id)
    _FUSED = {
        ".q_proj.": (".qkv_proj.", "q"),
        ".k_proj.": (".qkv_proj.", "k"),
        ".v_proj.": (".qkv_proj.", "v"),
        ".gate_proj.": (".gate_up_proj.", 0),
        ".up_proj.": (".gate_up_proj.", 1),
    }

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]],
                     packed: PackedParts | None = None) -> set[str]:
        """Copy Hugging Face-named tensors into the (fused) parameters, and with `packed` a
        quantized checkpoint's parts of each projection into its int4 buffers; returns the
        names of the parameters and buffers that were filled."""
        params = NamedTensors(self)
        loaded: set[str] = set()
        kv_scales = 0
        for name, tensor in weights:
            if "rotary_emb" in name:
                continue
            expert = _expert_target(name)
            if expert is not None:  # one expert's projection: a slice of a stacked one
                target, e, part = expert
                param = params[target]
                dest = param.data[e]
                if part is not None:
                    half = dest.shape[0] // 2
                    dest = dest[:half] if part == 0 else dest[half:]
                if dest.shape != tensor.shape:
                    raise ValueError(f"Shape mismatch for {name}: checkpoint "
                                     f"{tuple(tensor.shape)} vs model {tuple(dest.shape)}.")
                dest.copy_(tensor)
                loaded.add(target)
                continue
            if _is_kv_cache_scale(name):
                kv_scales += 1
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            target, shard = name.replace(".block_sparse_moe.", ".mlp."), None
            for frag, (fused, shard_id) in self._FUSED.items():
                if frag in name:
                    target, shard = name.replace(frag, fused), shard_id
                    break
            split = packed.split(name, tensor) if packed is not None else None
            if split is not None:
                layout = packed.add(split[0], split[1], tensor)
                prefix = target.rpartition(".")[0]
                if isinstance(layout, torch.Tensor):  # dequantized: a full-precision weight
                    name, target, tensor, split = f"{split[0]}.weight", f"{prefix}.weight", \
                        layout, None
            if split is not None:
                for part, value in zip(("qweight", "scale", "zero", "input_perm"),
                                       layout or ()):
                    buf = params[f"{prefix}.{part}"]
                    if part == "input_perm":  # one input order for a fused layer's parts
                        if f"{prefix}.{part}" in loaded and not torch.equal(
                                buf, value.to(buf.device)):
                            raise ValueError(f"{split[0]}: its inputs are ordered (g_idx) "
                                             "unlike the other parts of its fused layer.")
                        buf.copy_(value)
                        loaded.add(f"{prefix}.{part}")
                        continue
                    dest = buf if shard is None else self._shard_view(f"{prefix}.{part}", buf,
                                                                      shard)
                    if dest.shape != value.shape:
                        raise ValueError(f"Shape mismatch for {split[0]} ({part}): checkpoint "
                                         f"{tuple(value.shape)} vs model {tuple(dest.shape)}.")
                    dest.copy_(value)
                    loaded.add(f"{prefix}.{part}")
                continue
            if target not in params:
                raise ValueError(f"Checkpoint tensor {name!r} has no place in the model.")
            param = params[target]
            dest = param.data if shard is None else self._shard_view(target, param, shard)
            if dest.shape != tensor.shape:
                raise ValueError(f"Shape mismatch for {name}: checkpoint {tuple(tensor.shape)}"
                                 f" vs model {tuple(dest.shape)}.")
            dest.copy_(tensor)
            loaded.add(target)
        if packed is not None:
            packed.check_done()
        if kv_scales:
            logger.info("The checkpoint's %d KV-cache scales are not used: an fp8 KV cache "
                        "here has a scale of 1.", kv_scales)
        return loaded

    def _shard_view(self, name: str, param: torch.Tensor, shard) -> torch.Tensor:
        cfg = self.config
        if ".qkv_proj." in name:
            q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
            start, size = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[shard]
        else:  # gate_up: two halves (a dense MLP, or a shared expert of its own size)
            size = param.shape[0] // 2
            start = shard * size
        return param.data.narrow(0, start, size)


# A checkpoint's per-expert tensors: Mixtral's block_sparse_moe.experts.E.w1/w3/w2, Qwen's
# mlp.experts.E.gate_proj/up_proj/down_proj -> (stacked parameter, part of w13 or None).
_EXPERT_PARTS = {"w1": ("w13", 0), "w3": ("w13", 1), "w2": ("w2", None),
                 "gate_proj": ("w13", 0), "up_proj": ("w13", 1), "down_proj": ("w2", None)}


def _expert_target(name: str) -> tuple[str, int, int | None] | None:
    """(parameter name, expert, half of w13) of a per-expert checkpoint tensor."""
    if ".experts." not in name:
        return None
    prefix, _, rest = name.partition(".experts.")
    e, proj, _ = rest.split(".", 2)
    stacked, part = _EXPERT_PARTS[proj]
    prefix = prefix.replace(".block_sparse_moe", ".mlp")
    return f"{prefix}.{stacked}", int(e), part


def llama_parameter_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Hugging Face parameter names and shapes of a checkpoint for this config (Phi-3's
    q/k/v and gate/up stored fused, as its checkpoints have them)."""
    h, d = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    fused = cfg.family == "phi3"
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        if fused:
            shapes.update({p + "self_attn.qkv_proj.weight": (q + 2 * kv, h),
                           p + "mlp.gate_up_proj.weight": (2 * cfg.intermediate_size, h)})
        else:
            shapes.update({
                p + "self_attn.q_proj.weight": (q, h),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "mlp.gate_proj.weight": (cfg.intermediate_size, h),
                p + "mlp.up_proj.weight": (cfg.intermediate_size, h)})
        shapes.update({
            p + "self_attn.o_proj.weight": (h, q),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        })
        if cfg.moe and cfg.moe["sparse_layers"][i]:
            for key in [k for k in shapes if k.startswith(p + "mlp.")]:
                del shapes[key]  # no dense MLP in this layer
            shapes.update(_expert_shapes(cfg, p))
        else:
            shapes[p + "mlp.down_proj.weight"] = (h, cfg.intermediate_size)
        if cfg.qkv_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)})
        if cfg.o_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        if cfg.qk_norm:
            shapes.update({p + "self_attn.q_norm.weight": (d,),
                           p + "self_attn.k_norm.weight": (d,)})
    shapes["model.norm.weight"] = (h,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    return shapes


def _expert_shapes(cfg: ModelConfig, p: str) -> dict[str, tuple[int, ...]]:
    moe, h = cfg.moe, cfg.hidden_size
    size = moe["intermediate_size"]
    mixtral = cfg.family == "mixtral"
    base = p + ("block_sparse_moe." if mixtral else "mlp.")
    names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    shapes = {base + "gate.weight": (moe["num_experts"], h)}
    for e in range(moe["num_experts"]):
        shapes.update({f"{base}experts.{e}.{names[0]}.weight": (size, h),
                       f"{base}experts.{e}.{names[1]}.weight": (size, h),
                       f"{base}experts.{e}.{names[2]}.weight": (h, size)})
    shared = moe["shared_intermediate_size"]
    if shared:
        shapes.update({base + "shared_expert.gate_proj.weight": (shared, h),
                       base + "shared_expert.up_proj.weight": (shared, h),
                       base + "shared_expert.down_proj.weight": (h, shared),
                       base + "shared_expert_gate.weight": (1, h)})
    return shapes


LlamaForCausalLM.parameter_shapes = staticmethod(llama_parameter_shapes)
