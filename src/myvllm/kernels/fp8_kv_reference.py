"""The fp8 KV cache's formulas in PyTorch (Config.kv_cache_dtype="fp8", float8 e4m3): what
the references store and read; kernels/fp8_kv.py is the Triton side of the same formulas.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448: e4m3fn has no infinity to round to


def quantize_kv(x: torch.Tensor, cache_dtype: torch.dtype, scale: float) -> torch.Tensor:
    """x as the cache stores it: for fp8, x / scale clamped to +-448 (a plain cast would turn
    a larger value into NaN) and rounded to nearest; otherwise x cast to the cache's dtype."""
    if cache_dtype == FP8_DTYPE:
        return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return x.to(cache_dtype)


def dequantize_kv(stored: torch.Tensor, scale: float) -> torch.Tensor:
    """Cache elements back to values, in float32: fp8 ones times their scale."""
    if stored.dtype == FP8_DTYPE:
        return stored.float() * scale
    return stored.float()
