"""A mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE): a router picks k of E expert
MLPs per token; the token's output is their weighted sum (plus, in Qwen2-MoE, an always-on
shared expert behind a sigmoid gate).

The experts' weights are stacked, one tensor per projection: w13 [E, 2I, H] (gate rows,
then up rows) and w2 [E, H, I], filled from the checkpoint's per-expert tensors at load.
`experts_reference` is the plain computation (a loop over the experts the batch uses), the
CPU's path; with the Triton backend, csrc_triton.route_experts routes in one kernel and
csrc_triton.fused_moe computes the same as two grouped GEMMs over the tokens sorted by
expert, with no host sync (inside the CUDA graphs). The numerics follow transformers'
(the router's softmax in fp32, its top-k weights cast back).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .layers import GatedMLP, activation


def route(logits: torch.Tensor, top_k: int, renormalize: bool,
          dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] in dtype, expert ids [T, k] int64) of router logits [T, E]."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(dtype), ids


def _expert_weight(w: torch.Tensor, scale: torch.Tensor | None, zero: torch.Tensor | None,
                   e: int, in_features: int, dtype: torch.dtype) -> torch.Tensor:
    if scale is None:
        return w[e]
    if zero is not None:  # int4: packed codes, a scale and a zero point per group
        from .quantization import GROUP_SIZE, dequantize_int4
        return dequantize_int4(w[e], scale[e], zero[e], in_features, GROUP_SIZE).to(dtype)
    return (w[e].float() * scale[e][:, None]).to(dtype)  # e4m3 / int8 and their scales


def experts_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                      weights: torch.Tensor, ids: torch.Tensor, act,
                      w13_scale: torch.Tensor | None = None,
                      w2_scale: torch.Tensor | None = None,
                      w13_zero: torch.Tensor | None = None,
                      w2_zero: torch.Tensor | None = None) -> torch.Tensor:
    """sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) for each token t: for each expert
    the batch uses, its tokens in one matmul (quantized weights dequantized first)."""
    out = torch.zeros_like(x)
    hidden, inner = x.shape[-1], w2.shape[2] if w2_zero is None else w13.shape[1] // 2
    for e in torch.unique(ids).tolist():
        token, slot = torch.where(ids == e)
        w = _expert_weight(w13, w13_scale, w13_zero, e, hidden, x.dtype)
        gate, up = F.linear(x[token], w).chunk(2, -1)
        w = _expert_weight(w2, w2_scale, w2_zero, e, inner, x.dtype)
        y = F.linear(act(gate) * up, w)
        y = y * weights[token, slot, None]
        out.index_add_(0, token, y.to(out.dtype))
    return out


class MoE(nn.Module):
    def __init__(self, hidden: int, settings: dict, act: str = "silu",
                 backend: str = "torch") -> None:
        super().__init__()
        self.fused = backend == "triton"
        e, size = settings["num_experts"], settings["intermediate_size"]
        self.top_k = settings["top_k"]
        self.renormalize = settings["renormalize"]
        self.gate = nn.Linear(hidden, e, bias=False)  # the router
        self.w13 = nn.Parameter(torch.empty(e, 2 * size, hidden))
        self.w2 = nn.Parameter(torch.empty(e, hidden, size))
        self.act = activation(act)
        shared = settings["shared_intermediate_size"]
        self.shared_expert = GatedMLP(hidden, shared, act=act) if shared else None
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False) if shared else None
        self.w13_scale = self.w2_scale = None  # quantized experts: their scales,
        self.w13_zero = self.w2_zero = None    # and int4's zero points

    def quantize(self, method: str) -> None:
        """Store the experts' weights in e4m3 (fp8) or int8 with a scale per output
        channel, or in int4 with a scale and a zero point per group of 128 inputs."""
        from .quantization import quantize_fp8, quantize_int4, quantize_int8
        quantize = {"fp8": quantize_fp8, "int8": quantize_int8, "int4": quantize_int4}[method]
        for name in ("w13", "w2"):
            w = getattr(self, name).detach()
            experts, rows = w.shape[:2]
            # Per (expert, output row): a scale (int4: one per group, and zero points).
            q, *scales = quantize(w.reshape(-1, w.shape[-1]))
            delattr(self, name)
            self.register_buffer(name, q.view(experts, rows, -1))
            for suffix, t in zip(("_scale", "_zero"), scales):
                setattr(self, name + suffix, t.view(experts, rows, *t.shape[1:]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            import csrc_triton
            weights, ids = csrc_triton.route_experts(self.gate(x), self.top_k,
                                                     self.renormalize, x.dtype)
            out = csrc_triton.fused_moe(x, self.w13, self.w2, weights, ids, self.act,
                                        w13_scale=self.w13_scale, w2_scale=self.w2_scale,
                                        w13_zero=self.w13_zero, w2_zero=self.w2_zero)
        else:
            weights, ids = route(self.gate(x), self.top_k, self.renormalize, x.dtype)
            out = experts_reference(x, self.w13, self.w2, weights, ids, self.act,
                                    self.w13_scale, self.w2_scale, self.w13_zero,
                                    self.w2_zero)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
