"""The activation dtype's rounding, SiLU x up and the rotary pair as eager PyTorch computes
them: fp32 arithmetic rounded to the dtype where PyTorch's separate ops round. Shared by
fused.py's kernels and the batch-1 GEMV's epilogues (quant_gemm.py), so that both give the
same bytes. Loaded through _interpret.jit_helpers, like _fp8_cast."""

import triton
import triton.language as tl

try:  # CUDA's own expf (what PyTorch's CUDA kernels call)
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - very old triton
    libdevice = None


@triton.jit
def rne_bf16(x):
    """fp32 -> the nearest-even bf16 value, kept in fp32 (exactly convertible to bf16
    afterwards, even by the interpreter's truncating cast)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))


@triton.jit
def round_to(x, DT: tl.constexpr, INTERPRETED: tl.constexpr):
    """Round fp32 ``x`` to dtype code DT (0 fp32: no-op, 1 fp16, 2 bf16), returning fp32:
    what PyTorch's ``op(...).to(dtype)`` would hold."""
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
def round_opaque(x, DT: tl.constexpr, INTERPRETED: tl.constexpr):
    """round_to through inline PTX, which the compiler cannot see into: with FMA
    contraction on (the GEMV kernels keep it for their sums), LLVM turns round_to's cast
    pairs around a product and a sum into one 16-bit FMA, which skips the product's
    rounding (seen in the PTX: fma.rn.bf16)."""
    if INTERPRETED or DT == 0:
        y = round_to(x, DT, INTERPRETED)
    elif DT == 1:
        y = tl.inline_asm_elementwise(
            "{ .reg .b16 h; cvt.rn.f16.f32 h, $1; cvt.f32.f16 $0, h; }", "=r,r", [x],
            dtype=tl.float32, is_pure=True, pack=1)
    else:
        y = tl.inline_asm_elementwise(
            "{ .reg .b16 h; cvt.rn.bf16.f32 h, $1; cvt.f32.bf16 $0, h; }", "=r,r", [x],
            dtype=tl.float32, is_pure=True, pack=1)
    return y


@triton.jit
def silu_mul(g, u, DT: tl.constexpr, INTERPRETED: tl.constexpr):
    """F.silu(g) * u from g and u already in the dtype: silu as x / (1 + exp(-x)) in fp32
    (CUDA: expf and an IEEE division), rounded, then the product rounded."""
    if INTERPRETED:
        s = g / (1.0 + tl.exp(-g))
    else:
        s = tl.math.div_rn(g, 1.0 + libdevice.exp(-g))
    return round_to(round_to(s, DT, INTERPRETED) * u, DT, INTERPRETED)


@triton.jit
def rotate(x1, x2, c1, s1, c2, s2, DT: tl.constexpr, INTERPRETED: tl.constexpr):
    """The neox rotary pair (x1 of a head's first half, x2 of its second): x*cos +
    cat(-x2, x1)*sin, each product and the sum rounded to DT like PyTorch's ops (the
    products through round_opaque). Where DT is fp32 the kernel must be compiled without
    FMA contraction (fused.py's are; the GEMV epilogues take 16-bit rows only)."""
    o1 = round_to(round_opaque(x1 * c1, DT, INTERPRETED) +
                  round_opaque(-x2 * s1, DT, INTERPRETED), DT, INTERPRETED)
    o2 = round_to(round_opaque(x2 * c2, DT, INTERPRETED) +
                  round_opaque(x1 * s2, DT, INTERPRETED), DT, INTERPRETED)
    return o1, o2
