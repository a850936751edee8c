"""The e4m3 casts: the KV-cache stores (kv_cache_dtype="fp8", scale 1), shared by
_kernels.py and fused.py, and W8A8's activations (quant_gemm.py's and fused.py's). Loaded
through _interpret.jit_helpers, so that a module's interpreted copy calls an interpreted
copy of it."""

import triton
import triton.language as tl


@triton.jit
def to_cache(x, dtype: tl.constexpr):
    """x in the cache's dtype. e4m3 saturates at +-448 (as the reference attention's cache
    does, where a plain cast would give NaN) and is rounded to nearest even here, in fp32,
    before the cast: the GPU's cast rounds so too, Triton's interpreter does not (ties
    away from zero, and a mantissa rounded up past 2 loses its carry)."""
    if dtype.is_fp8():
        x = x.to(tl.float32)  # (the interpreter compares bf16 as its raw bits)
        a = tl.minimum(tl.abs(x), 448.0)
        e = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6) - 3
        ulp = ((e + 127) << 23).to(tl.float32, bitcast=True)  # e4m3's last place at a
        inv = ((127 - e) << 23).to(tl.float32, bitcast=True)
        r = ((a * inv + 12582912.0) - 12582912.0) * ulp
        x = tl.where(x < 0, -r, r)
    return x.to(dtype)


@triton.jit
def activation_bytes(x, scale, INTERPRETED: tl.constexpr):
    """fp32 x / scale in e4m3, as bytes: W8A8's activations, a token's row scaled so that
    its absolute maximum is 448 (what quantization.quantize_activations_fp8 computes).
    div_rn: torch divides exactly, Triton's default division is approximate."""
    v = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -448.0), 448.0)
    if INTERPRETED:  # its own cast mis-rounds (see to_cache)
        q = to_cache(v, tl.float8e4nv)
    else:
        q = v.to(tl.float8e4nv)
    return q.to(tl.uint8, bitcast=True)
