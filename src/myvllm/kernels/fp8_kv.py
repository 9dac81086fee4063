"""Triton helpers of the fp8 KV cache (Config.kv_cache_dtype="fp8"): the store kernel
quantizes, the attention kernels dequantize each K/V tile as they load it.

    stored = fp8(clamp(x / scale, -448, 448))        store_kvcache
    x     ~= fp32(stored) * scale                    prefill / decode attention

Both are no-ops for a cache of the model's dtype (decided at compile time from the cache's
element type), so that path compiles to exactly the code it had before. The PyTorch
references (reference.quantize_kv / dequantize_kv) are the same formulas.
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


@triton.jit
def dequantize_kv(tile, scale, COMPUTE_DTYPE: tl.constexpr):
    """A loaded cache tile as values in the dtype of the queries (tl.dot needs both operands
    in one dtype, and bf16/fp16 keep the tensor cores' fast path): fp8 times its scale."""
    if tile.dtype.is_fp8():
        tile = (tile.to(tl.float32) * scale).to(COMPUTE_DTYPE)
    return tile
