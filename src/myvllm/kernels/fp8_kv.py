"""Triton helpers of the fp8 KV cache (Config.kv_cache_dtype="fp8"): the store kernel
quantizes, the attention kernels dequantize each K/V tile as they load it.

    stored = fp8(clamp(x / scale, -448, 448))        store_kvcache
    x     ~= fp32(stored) * scale                    prefill / decode attention

The attention kernels do the multiplication where it is cheapest, not on each [keys, D]
tile: a loaded tile is only cast (exactly: bf16 and fp16 hold every e4m3 value), k_scale
multiplies the scores (folded into the softmax scale once per program, since
q . (s k) = s (q . k)) and v_scale the probabilities before they weigh V (sum p (s v) =
s sum p v; the softmax's denominator sums the unscaled p). The decode kernels go one step
further: k_scale and the softmax scale multiply the queries once (fold_into_queries), v_scale
the output once (cache_scale), so nothing is scaled per key. That leaves one conversion per
element of the cache, the least an fp8 cache can cost. For a bf16 model the conversion is to
fp16, not bf16: e4m3 -> fp16 is a single instruction on the GPU, and the queries are cast to
fp16 once per program for the dot products (queries_for_cache; fp16 holds them more finely
than bf16, clamped to its range).

All of it is a no-op for a cache of the model's dtype (decided at compile time from the
cache's element type), so that path compiles to exactly the code it had before. The PyTorch
references (fp8_kv_reference.quantize_kv / dequantize_kv) are the same formulas.
"""

from __future__ import annotations

import triton
import triton.language as tl

# e4m3fn has no infinity: a cast of anything beyond its largest value (448) gives NaN, so
# values are clamped first and saturate instead.
FP8_MAX = tl.constexpr(448.0)


@triton.jit
def quantize_kv(x, scale, CACHE_DTYPE: tl.constexpr):
    """x as the cache stores it: / scale, clamped and rounded for fp8; else a plain cast."""
    if CACHE_DTYPE.is_fp8():
        x = tl.clamp(x.to(tl.float32) / scale, -FP8_MAX, FP8_MAX)
    return x.to(CACHE_DTYPE)


FP16_MAX = tl.constexpr(65504.0)


@triton.jit
def queries_for_cache(q, CACHE_DTYPE: tl.constexpr):
    """The queries in the dtype the dot products run in: fp16 for bf16 queries over an fp8
    cache (see the module docstring), else unchanged (fp16 already; fp32 stays exact)."""
    if CACHE_DTYPE.is_fp8():
        if q.dtype.is_bf16():
            q = tl.clamp(q.to(tl.float32), -FP16_MAX, FP16_MAX).to(tl.float16)
    return q


@triton.jit
def fold_into_queries(q, factor, CACHE_DTYPE: tl.constexpr):
    """For an fp8 cache, q * factor (the softmax scale and k_scale, folded in once per
    program instead of multiplying every score) in the dtype the dot products run in, rounded
    once: fp16 for 16-bit queries (see queries_for_cache), float32 stays float32. Any other
    cache: q unchanged (its scores are scaled after the dot)."""
    if CACHE_DTYPE.is_fp8():
        if q.dtype.is_fp32():
            q = q * factor
        else:
            q = tl.clamp(q.to(tl.float32) * factor, -FP16_MAX, FP16_MAX).to(tl.float16)
    return q


@triton.jit
def dequantize_kv(tile, COMPUTE_DTYPE: tl.constexpr):
    """A loaded cache tile in the dtype of the queries (tl.dot needs both operands in one
    dtype, and bf16/fp16 keep the tensor cores' fast path); its scale is applied elsewhere
    (cache_scale, scale_probs)."""
    return tile.to(COMPUTE_DTYPE)


@triton.jit
def cache_scale(scale, CACHE_DTYPE: tl.constexpr):
    """What a cache of this dtype's values are multiplied by: scale for fp8, else 1."""
    factor = 1.0
    if CACHE_DTYPE.is_fp8():
        factor = scale
    return factor


@triton.jit
def scale_probs(p, v_scale, CACHE_DTYPE: tl.constexpr):
    """The probabilities that weigh an fp8 V tile, times v_scale; unchanged otherwise."""
    if CACHE_DTYPE.is_fp8():
        p = p * v_scale
    return p
