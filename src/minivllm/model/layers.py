"""Building blocks shared by the decoder models: RMSNorm (and Gemma's), rotary embedding,
gated MLP, the activations.

The numerics follow Hugging Face transformers' implementations (where each cast happens),
so that fp32 greedy output matches token for token and bf16 stays as close as it can.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

import csrc_triton


class NamedTensors:
    """A model's parameters and buffers by their names, looked up at each use (a loader
    may allocate a layer's tensors while the checkpoint streams in)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def __getitem__(self, name: str) -> torch.Tensor:
        path, _, attr = name.rpartition(".")
        try:
            module = self.model.get_submodule(path)
        except AttributeError:
            raise KeyError(name) from None
        t = module._parameters.get(attr)
        if t is None:
            t = module._buffers.get(attr)
        if t is None:
            raise KeyError(name)
        return t

    def __contains__(self, name: str) -> bool:
        try:
            self[name]
        except KeyError:
            return False
        return True


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        in_dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(in_dtype)


class GemmaRMSNorm(RMSNorm):
    """Gemma's: the weight is an offset from 1, and multiplies in fp32 before the cast."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__(size, eps)
        nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)


def activation(name: str):
    """The MLP activation a config names (transformers' ACT2FN entries we support)."""
    if name == "silu":
        return F.silu
    if name == "gelu_pytorch_tanh":
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "gelu_new":  # transformers' NewGELUActivation, written out as it is there
        return lambda x: 0.5 * x * (1.0 + torch.tanh(
            math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))
    if name == "gelu":
        return F.gelu
    raise ValueError(f"Unsupported activation {name!r}.")


def rope_inverse_frequencies(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    if scaling.get("rope_type") == "linear":  # positions divided by `factor`
        return inv_freq / scaling["factor"]
    # Llama 3.x: long wavelengths slowed by `factor`, short ones kept, a smooth ramp between.
    factor = scaling["factor"]
    low_ff = scaling.get("low_freq_factor", 1.0)
    high_ff = scaling.get("high_freq_factor", 4.0)
    old_len = scaling.get("original_max_position_embeddings", 8192)
    low_wavelen = old_len / low_ff
    high_wavelen = old_len / high_ff
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low_ff) / (high_ff - low_ff)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding with a precomputed cos/sin table indexed by position."""

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: dict | None, max_position_embeddings: int | None = None) -> None:
        super().__init__()
        self.head_dim, self.max_positions = head_dim, max_positions
        self.theta, self.scaling = theta, scaling
        self.max_position_embeddings = max_position_embeddings or max_positions
        self.register_buffer("cos_table", torch.empty(0), persistent=False)
        self.register_buffer("sin_table", torch.empty(0), persistent=False)
        self.reset_tables(self.cos_table.device)

    def reset_tables(self, device: torch.device) -> None:
        """(Re)build the fp32 cos/sin tables; the loader calls this after moving the model,
        so the tables stay fp32 whatever the model's dtype."""
        if device.type == "meta":
            return
        with torch.device("cpu"):
            pos = torch.arange(self.max_positions, dtype=torch.float32)
            scale = 1.0
            if self.scaling is not None and self.scaling.get("rope_type") == "longrope":
                from .families import longrope_tables
                short, long, original, scale = longrope_tables(
                    self.head_dim, self.theta, self.scaling, self.max_position_embeddings)
                freqs = torch.where((pos < original)[:, None], pos[:, None] * short[None, :],
                                    pos[:, None] * long[None, :])
            else:
                inv_freq = rope_inverse_frequencies(self.head_dim, self.theta, self.scaling)
                freqs = pos[:, None] * inv_freq[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
        self.cos_table = (emb.cos() * scale).to(device)
        self.sin_table = (emb.sin() * scale).to(device)

    def forward(self, positions: torch.Tensor, q: torch.Tensor,
                k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # q: [T, Hq, D], k: [T, Hkv, D]
        cos = self.cos_table[positions].to(q.dtype).unsqueeze(1)
        sin = self.sin_table[positions].to(q.dtype).unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Linear(nn.Linear):
    """A decoder projection: nn.Linear, except that with the fused kernels on (fused_ops) a
    single row (batch-1 decode) of 16-bit weights goes to the Triton GEMV kernel
    (csrc_triton.linear_gemv) instead of cuBLAS. On the H200, Llama-3.1-8B's q/k/v, o,
    gate/up and down projections took 14.5, 10.3, 55.3 and 29.5 us there against cuBLAS's
    16.8, 13.3, 57.3 and 32.4 (docs/decisions.md)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 fused_ops: bool = False, device=None, dtype=None) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.fused_ops = fused_ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (self.fused_ops and x.shape[0] == 1 and x.is_cuda and x.dtype == self.weight.dtype
                and x.dtype in (torch.float16, torch.bfloat16)
                and not torch.compiler.is_compiling()):
            return csrc_triton.linear_gemv(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)

    def gemv_weight(self, x: torch.Tensor) -> None:
        """16-bit weights take no GEMV epilogue (QuantizedLinear.gemv_weight): their GEMV
        runs 4 programs an SM, too few to hide each program's epilogue, which cost more
        than the kernel it saves (Llama-3.1-8B W2 bf16: 234.5 tok/s with both epilogues,
        238.2 with the rotary one, 241.4 without; docs/decisions.md)."""
        return None


class GatedMLP(nn.Module):
    """act(gate) * up MLP (SwiGLU; Gemma's GeGLU) with the gate and up projections fused
    into one matmul. The fused kernels are SiLU's."""

    def __init__(self, hidden: int, intermediate: int, fused_ops: bool = False,
                 act: str = "silu") -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias=False, fused_ops=fused_ops)
        self.down_proj = Linear(intermediate, hidden, bias=False, fused_ops=fused_ops)
        self.act = activation(act)
        self.fused_ops = fused_ops and act == "silu"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused_ops:
            w = self.gate_up_proj.gemv_weight(x)
            if w is not None:  # batch-1 decode: SiLU x up as the GEMV's epilogue
                return self.down_proj(csrc_triton.gemv_silu_and_mul(x, w))
            return self.down_proj(csrc_triton.silu_and_mul(self.gate_up_proj(x)))
        gate_up = self.gate_up_proj(x)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)
