"""Quantized linear layers: a projection's weight kept in 8 or 4 bits with its scales.

Methods (vLLM's names):
  fp8   e4m3 weights, one scale per output channel. Steps of more than
        FP8_ACTIVATION_MIN_TOKENS token also round the activations to e4m3 (one scale
        per token, computed each step: W8A8) and multiply on FP8 tensor cores
        (csrc_triton.fp8_scaled_mm: cuBLAS, or a split-K Triton kernel at decode-sized
        batches); a single token keeps its activations (a weight-only GEMV).
  int8  weight-only int8, one scale per output channel (symmetric).
  int4  weight-only 4 bits, groups of GROUP_SIZE along the input dimension, each with a
        scale and a zero point (asymmetric, round to nearest); two weights per byte,
        in blocks laid out for the kernels (int4_half). A weight that already lies on a
        4-bit grid (a checkpoint stored in 4 bits, e.g. GGUF's Q4_1, converted to floats)
        keeps that grid instead: groups of 32, a float zero point each (own_int4_grid).

On a GPU, int8, int4 and fp8's single tokens go through Triton kernels that read the
packed weights (csrc_triton/quant_gemm.py). Every method also runs through a reference
path (the weight dequantized, then an fp32 matmul), which is what the CPU uses: slow,
exact to the stored numbers, and what the kernels are tested against. Only the decoder layers' projections
are quantized; the embeddings and the LM head keep the model's dtype (as vLLM does).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

import csrc_triton

# The packed int4 layout's helpers, also used from here by the loaders and tests.
from csrc_triton.int4_layout import (int4_half, int4_packed_bytes, pack_int4,  # noqa: F401
                                     unpack_int4)

METHODS = ("fp8", "int8", "int4")
# Read from a quantized checkpoint (prequantized.py), by the checkpoint's quant_method.
CHECKPOINT_METHODS = ("gptq", "awq", "compressed-tensors")
GROUP_SIZE = 128
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448


def check_method(method: str | None) -> str | None:
    if method is None:
        return None
    if method not in METHODS + CHECKPOINT_METHODS:
        raise ValueError(f"quantization must be one of {METHODS + CHECKPOINT_METHODS} (or "
                         f"None), got {method!r}.")
    return method


def check_device(method: str | None, device: torch.device) -> None:
    """A clear error for a method the device cannot run."""
    if method == "fp8" and device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        if cap < (8, 9):
            raise ValueError(f"quantization='fp8' needs FP8 tensor cores (compute capability "
                             f"8.9 or newer); this GPU has {cap[0]}.{cap[1]}.")


# ---- weights ------------------------------------------------------------------------

def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [out, in], fp32 scale [out]): w ~ q * scale, per output channel."""
    w = w.float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def quantize_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [out, in], fp32 scale [out]) with each row's largest value at FP8_MAX."""
    w = w.float()
    scale = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=1e-12)
    return (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_int4(w: torch.Tensor, group_size: int = GROUP_SIZE
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed uint8 [out, int4_packed_bytes], fp32 scales [out, groups], uint8 zeros [out,
    groups]): each group of group_size inputs of a row (the last one may be shorter) maps
    its [min, max] onto 0..15; w ~ (q - zero) * scale; packed by pack_int4."""
    out_f, in_f = w.shape
    groups = -(-in_f // group_size)
    padded = torch.zeros(out_f, groups * group_size, dtype=torch.float32, device=w.device)
    padded[:, :in_f] = w.float()
    g = padded.view(out_f, groups, group_size)
    # The padding must not widen a group's range: take min/max over the real inputs only.
    valid = torch.arange(groups * group_size, device=w.device).view(groups, group_size) < in_f
    lo = torch.where(valid, g, torch.inf).amin(dim=2).clamp(max=0.0)
    hi = torch.where(valid, g, -torch.inf).amax(dim=2).clamp(min=0.0)
    scale = ((hi - lo) / 15.0).clamp(min=1e-12)
    zero = torch.round(-lo / scale).clamp(0, 15)
    q = (torch.round(g / scale[..., None]) + zero[..., None]).clamp(0, 15)
    q = q.view(out_f, -1)[:, :in_f].to(torch.uint8)
    return pack_int4(q, int4_half(group_size, in_f)), scale, zero.to(torch.uint8)


OWN_GRID_GROUP = 32  # GGUF's 4-bit blocks
_OWN_GRID_TOLERANCE = 0.2  # of a step: bf16 copies of the values pass (their rounding
# reaches ~0.1 step), other weights do not (each value off by up to half a step)


def own_int4_grid(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(packed, fp32 scales, fp32 zero points) when every group of 32 inputs of w holds
    values evenly spaced in 15 steps from its minimum to its maximum, as a checkpoint
    quantized to 4 bits with a minimum and a step per block (llama.cpp's Q4_1) is after
    conversion to floats; None otherwise. Re-quantizing such weights onto another 4-bit
    grid (groups of 128 with an integer zero point) adds a second rounding: +57.6%
    perplexity on the default model, whose GGUF is Q4_1, against none on its own grid."""
    out_f, in_f = w.shape
    if in_f % OWN_GRID_GROUP:
        return None
    for rows in (slice(0, 8), slice(None)):  # random weights fail on the first rows
        g = w[rows].float().reshape(-1, in_f // OWN_GRID_GROUP, OWN_GRID_GROUP)
        lo, hi = g.amin(dim=2), g.amax(dim=2)
        scale = torch.where(hi > lo, (hi - lo) / 15.0, lo.abs().clamp(min=1.0))
        steps = (g - lo[..., None]) / scale[..., None]
        q = steps.round()
        if (steps - q).abs().amax() > _OWN_GRID_TOLERANCE:
            return None
    q = q.reshape(out_f, in_f).to(torch.uint8)
    return pack_int4(q, int4_half(OWN_GRID_GROUP, in_f)), scale, -lo / scale


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                    in_features: int, group_size: int = GROUP_SIZE) -> torch.Tensor:
    q = unpack_int4(packed, in_features, int4_half(group_size, in_features)).float()
    expand = lambda t: t.float().repeat_interleave(group_size, dim=1)[:, :in_features]  # noqa: E731
    return (q - expand(zero)) * expand(scale)


def quantize_activations_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [T, in], fp32 scale [T, 1]): one scale per token (row)."""
    x = x.float()
    scale = (x.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


# ---- the layer ------------------------------------------------------------------------

# fp8 quantizes the activations of steps with more tokens than this, where FP8 tensor
# cores win (csrc_triton.fp8_scaled_mm); a single token (batch-1 decode) keeps its
# activations and goes to the weight-only GEMV. Llama-3.1-8B's decode step on the H200 at
# context 1024, batch 2 / 8 / 16 / 32: 3.48 / 3.76 / 4.06 / 4.83 ms W8A8 against
# 3.84 / 4.38 / 4.66 / 6.12 weight-only (docs/decisions.md, "W8A8 at decode-sized batches").
FP8_ACTIVATION_MIN_TOKENS = 1


def quantizes_activations(x: torch.Tensor) -> bool:
    return x.numel() > FP8_ACTIVATION_MIN_TOKENS * x.shape[-1]


class Fp8Activations(NamedTuple):
    """A W8A8 projection's input already in e4m3, written by the norm before it instead
    of a 16-bit tensor: the bytes and per-token scales that fp8_quantize_rows of that
    tensor would give, without a kernel of its own (docs/decisions.md)."""
    q: torch.Tensor      # [T, in] e4m3
    scale: torch.Tensor  # [T, 1] fp32


def fp8_activations_for(layer: nn.Module | None, tokens: int,
                        device: torch.device) -> Fp8Activations | None:
    """Empty buffers for `tokens` rows of `layer`'s input if layer multiplies them in
    W8A8 (fp8 weights, more than FP8_ACTIVATION_MIN_TOKENS rows, in and out sizes
    _scaled_mm takes); else None, and the kernel before writes its usual output."""
    if not (isinstance(layer, QuantizedLinear) and layer.method == "fp8"
            and layer.input_perm is None
            and tokens > FP8_ACTIVATION_MIN_TOKENS
            and layer.in_features % 16 == 0 and layer.out_features % 16 == 0):
        return None
    return Fp8Activations(
        torch.empty(tokens, layer.in_features, dtype=FP8, device=device),
        torch.empty(tokens, 1, dtype=torch.float32, device=device))


class QuantizedLinear(nn.Module):
    """y = x W^T + b with W stored quantized (see the module docstring). Built from a
    full-precision nn.Linear by from_linear; buffers, not parameters (nothing trains)."""

    def __init__(self, method: str, in_features: int, out_features: int,
                 bias: torch.Tensor | None, out_dtype: torch.dtype,
                 group_size: int = GROUP_SIZE) -> None:
        super().__init__()
        self.method = check_method(method)
        self.in_features, self.out_features = in_features, out_features
        self.out_dtype = out_dtype
        self.group_size = group_size  # int4's
        self.register_buffer("bias", bias)
        # A GPTQ act-order checkpoint's groups gather inputs from anywhere in the row: the
        # packed weights hold input input_perm[j] at j, and x is reordered to match.
        self.register_buffer("input_perm", None)

    @classmethod
    def empty_int4(cls, linear: nn.Linear, group_size: int,
                   act_order: bool = False) -> QuantizedLinear:
        """An int4 layer of linear's shape with its buffers unfilled (on linear's device,
        meta included), for a checkpoint quantized ahead; group_size -1: one group;
        act_order: with an input order to fill too."""
        n, k = linear.out_features, linear.in_features
        group = k if group_size < 0 else group_size
        dev = linear.weight.device
        bias = None if linear.bias is None else torch.empty(n, dtype=linear.bias.dtype,
                                                            device=dev)
        layer = cls("int4", k, n, bias, linear.weight.dtype, group)
        groups = -(-k // group)
        packed = int4_packed_bytes(k, int4_half(group, k))
        layer.register_buffer("qweight", torch.empty(n, packed, dtype=torch.uint8, device=dev))
        layer.register_buffer("scale", torch.empty(n, groups, dtype=torch.float32, device=dev))
        layer.register_buffer("zero", torch.empty(n, groups, dtype=torch.uint8, device=dev))
        if act_order:
            layer.register_buffer("input_perm", torch.empty(k, dtype=torch.long, device=dev))
        return layer

    @classmethod
    def from_linear(cls, linear: nn.Linear, method: str) -> QuantizedLinear:
        w = linear.weight.detach()
        bias = None if linear.bias is None else linear.bias.detach().clone()
        layer = cls(method, linear.in_features, linear.out_features, bias, w.dtype)
        if method == "int8":
            q, scale = quantize_int8(w)
            layer.register_buffer("qweight", q)
            layer.register_buffer("scale", scale)
        elif method == "fp8":
            q, scale = quantize_fp8(w)
            layer.register_buffer("qweight", q)
            layer.register_buffer("scale", scale)
        else:
            own = own_int4_grid(w)
            if own is None:
                packed, scale, zero = quantize_int4(w)
            else:
                (packed, scale, zero), layer.group_size = own, OWN_GRID_GROUP
            layer.register_buffer("qweight", packed)
            layer.register_buffer("scale", scale)
            layer.register_buffer("zero", zero)
        return layer

    @classmethod
    def empty_per_channel(cls, linear: nn.Linear, method: str) -> QuantizedLinear:
        """An fp8 or int8 layer of linear's shape (one scale per output) with its buffers
        unfilled."""
        n, k = linear.out_features, linear.in_features
        dev = linear.weight.device
        bias = None if linear.bias is None else torch.empty(n, dtype=linear.bias.dtype,
                                                            device=dev)
        layer = cls(method, k, n, bias, linear.weight.dtype)
        dtype = FP8 if method == "fp8" else torch.int8
        layer.register_buffer("qweight", torch.empty(n, k, dtype=dtype, device=dev))
        layer.register_buffer("scale", torch.empty(n, dtype=torch.float32, device=dev))
        return layer

    def restore_storage_dtypes(self) -> None:
        """Module.to(dtype) casts every floating buffer, fp8 weights and fp32 scales too:
        bring an unfilled layer's back (nothing is lost, they hold nothing yet)."""
        if self.method == "fp8":
            self.qweight = torch.empty_like(self.qweight, dtype=FP8)
        self.scale = self.scale.float()

    def dequantized_weight(self) -> torch.Tensor:
        """The weight as the stored numbers give it, fp32 [out, in] (with input_perm: its
        inputs in that order)."""
        if self.method == "int4":
            return dequantize_int4(self.qweight, self.scale, self.zero, self.in_features,
                                   self.group_size)
        return self.qweight.float() * self.scale[:, None]

    def gemv_weight(self, x: torch.Tensor | Fp8Activations,
                    any_device: bool = False) -> csrc_triton.GemvWeight | None:
        """The weights for the batch-1 GEMV kernels with an epilogue (SiLU x up, the
        rotary embedding and the K/V store) when x goes there: one 16-bit row on a GPU,
        8-bit weights (whose GEMV programs are many to an SM, so each one's epilogue
        hides behind the others' loads), inputs in their order; else None. any_device:
        on a CPU too, where the kernels run interpreted (tests)."""
        if (isinstance(x, torch.Tensor) and (x.is_cuda or any_device)
                and x.dim() == 2 and x.shape[0] == 1
                and x.dtype in (torch.float16, torch.bfloat16)
                and self.method in ("fp8", "int8") and self.input_perm is None
                and not quantizes_activations(x) and not torch.compiler.is_compiling()):
            codes = self.qweight.view(torch.uint8) if self.method == "fp8" else self.qweight
            return csrc_triton.GemvWeight(codes, self.scale, self.bias, self.method)
        return None

    def forward(self, x: torch.Tensor | Fp8Activations) -> torch.Tensor:
        if isinstance(x, Fp8Activations):
            return self._fp8_scaled_mm(*x) if x.q.is_cuda else self.reference(x)
        if self.input_perm is not None:
            x = x.index_select(-1, self.input_perm)
        if not x.is_cuda:
            return self.reference(x)
        if self.method == "fp8":
            if not quantizes_activations(x):
                return csrc_triton.fp8_weight_gemm(x, self.qweight, self.scale, self.bias)
            if self.in_features % 16 or self.out_features % 16:
                return self.reference(x)  # _scaled_mm takes multiples of 16 only
            shape = x.shape
            y = self._fp8_scaled_mm(
                *csrc_triton.fp8_quantize_rows(x.reshape(-1, self.in_features)))
            return y.reshape(*shape[:-1], self.out_features)
        if self.method == "int8":
            return csrc_triton.int8_gemm(x, self.qweight, self.scale, self.bias)
        return csrc_triton.int4_gemm(x, self.qweight, self.scale, self.zero, self.group_size,
                                     self.bias)

    def reference(self, x: torch.Tensor | Fp8Activations) -> torch.Tensor:
        """Dequantize, fp32 matmul (fp8: of the fp8-rounded activations too)."""
        if isinstance(x, Fp8Activations):
            shape, x32 = x.q.shape, x.q.float() * x.scale
        else:
            shape, x = x.shape, x.reshape(-1, self.in_features)
            if self.method == "fp8" and quantizes_activations(x):
                xq, xs = quantize_activations_fp8(x)
                x32 = xq.float() * xs
            else:
                x32 = x.float()
        y = x32 @ self.dequantized_weight().t()
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(self.out_dtype).reshape(*shape[:-1], self.out_features)

    def _fp8_scaled_mm(self, xq: torch.Tensor, xs: torch.Tensor) -> torch.Tensor:
        """[T, out] from e4m3 rows [T, in] and their scales [T, 1], on FP8 tensor cores
        (decode-sized T: a split-K Triton kernel; more: cuBLAS)."""
        return csrc_triton.fp8_scaled_mm(xq, xs, self.qweight, self.scale, self.bias,
                                         self.out_dtype)

    def extra_repr(self) -> str:
        return f"{self.method}, in={self.in_features}, out={self.out_features}"


# The decoder layers' projections that are quantized.
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def quantized_shells(model: nn.Module, layout: str, group_size: int = GROUP_SIZE,
                     act_order: bool = False) -> None:
    """Replace every decoder projection by an unfilled QuantizedLinear of `layout` ("int4",
    "int8" or "fp8"), for a checkpoint quantized ahead to fill."""
    for module in list(model.modules()):
        for name in PROJECTIONS:
            linear = getattr(module, name, None)
            if isinstance(linear, nn.Linear):
                setattr(module, name, QuantizedLinear.empty_int4(linear, group_size, act_order)
                        if layout == "int4" else
                        QuantizedLinear.empty_per_channel(linear, layout))


def quantize_model(model: nn.Module, method: str) -> None:
    """Replace every decoder projection by its QuantizedLinear, freeing the full-precision
    weight as it goes (peak memory: the model plus one projection)."""
    from ..worker.tensor_parallel import RowParallel
    from .moe import MoE
    replaced = 0
    for module in list(model.modules()):
        for name in PROJECTIONS:
            linear = getattr(module, name, None)
            owner = module
            if isinstance(linear, RowParallel):  # a split projection: its own part
                owner, name, linear = linear, "linear", linear.linear
            if isinstance(linear, nn.Linear):
                setattr(owner, name, QuantizedLinear.from_linear(linear, method))
                replaced += 1
        if isinstance(module, MoE):
            module.quantize(method)
    if not replaced:
        raise ValueError(f"quantization={method!r}: {type(model).__name__} has no decoder "
                         "projections this engine quantizes (GPT-2 is not quantized yet).")
