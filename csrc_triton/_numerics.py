"""PyTorch's eager numerics inside Triton kernels: rounding to the activation dtype where
PyTorch's separate ops round, its RMSNorm's inverse root and F.silu's formula. Shared by
fused.py and quant_gemm.py's fused GEMV prologues; loaded through _interpret.jit_helpers,
so that a module's interpreted copy calls an interpreted copy of these.

Under the interpreter bf16 casts truncate instead of rounding, so bf16 is rounded by hand
there (rne_bf16); compiled kernels use the native round-to-nearest-even conversion."""

import triton
import triton.language as tl

try:  # CUDA's own expf/rsqrtf (what PyTorch's CUDA kernels call)
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - very old triton
    libdevice = None


@triton.jit
def rne_bf16(x):
    """fp32 -> the nearest-even bf16 value, kept in fp32 (exactly convertible
    to bf16 afterwards, even by the interpreter's truncating cast)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))


@triton.jit
def round_to(x, DT: tl.constexpr, INTERPRETED: tl.constexpr):
    """Round fp32 ``x`` to dtype code DT (0 fp32: no-op, 1 fp16, 2 bf16),
    returning fp32: what PyTorch's ``op(...).to(dtype)`` would hold."""
    y = x
    if DT == 1:
        y = x.to(tl.float16).to(tl.float32)
    if DT == 2:
        if INTERPRETED:
            y = rne_bf16(x)
        else:
            y = x.to(tl.bfloat16).to(tl.float32)
    return y


@triton.jit
def add(a, b):
    return a + b


@triton.jit
def sum_last(x, INTERPRETED: tl.constexpr):
    """Sum over the last of two axes.  Under the interpreter, tl.sum is unusable when
    triton itself was imported without TRITON_INTERPRET=1 (it is then a compiled-only
    @jit helper), so reduce with our own combine function."""
    if INTERPRETED:
        s = tl.reduce(x, 1, add)
    else:
        s = tl.sum(x, axis=1)
    return s


@triton.jit
def inv_rms(sumsq, eps, inv_d, d_f, INTERPRETED: tl.constexpr):
    """rsqrt(mean(x^2) + eps) as PyTorch computes it: on CPU mean = sum / n
    and rsqrt = 1 / sqrt; on CUDA mean = sum * (1/n) and rsqrt = rsqrtf."""
    if INTERPRETED:
        r = 1.0 / tl.sqrt(sumsq / d_f + eps)
    else:
        r = libdevice.rsqrt(sumsq * inv_d + eps)
    return r


@triton.jit
def silu(g, INTERPRETED: tl.constexpr):
    """F.silu in fp32: x / (1 + exp(-x)) (CUDA: expf and an IEEE division)."""
    if INTERPRETED:
        s = g / (1.0 + tl.exp(-g))
    else:
        s = tl.math.div_rn(g, 1.0 + libdevice.exp(-g))
    return s
