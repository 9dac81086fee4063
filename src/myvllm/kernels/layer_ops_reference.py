"""Plain-PyTorch versions of a decoder layer's three small per-token ops (rms_norm, norm_rope,
silu_and_mul): what a CPU runs, and the oracle of kernels/layer_ops_triton.py. Numerics as
HF transformers: the residual sum rounded to the model dtype, the norm and the rotation in
float32, F.silu rounded before the multiply.
"""

from __future__ import annotations

from typing import overload

import torch
import torch.nn.functional as F


# rms_norm_ref returns one tensor, or (out, residual stream) when given a residual; the
# overloads tell the type checker which.
@overload
def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: None = None) -> torch.Tensor: ...
@overload
def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...
def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last axis. With residual: returns (rmsnorm(x + residual), x + residual)."""
    if residual is not None:
        # The add happens in float32 and is rounded once, like HF's `residual + hidden`.
        new_residual = (x.float() + residual.float()).to(x.dtype)
        return rms_norm_ref(new_residual, weight, eps), new_residual
    dtype = x.dtype
    x32 = x.float()
    variance = x32.pow(2).mean(dim=-1, keepdim=True)
    return (x32 * torch.rsqrt(variance + eps)).to(dtype) * weight


def norm_rope_ref(
    x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
    norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
) -> torch.Tensor:
    """x [N, H, D] (one row per token) -> RoPE(rmsnorm_per_head(x)) [N, H, D], contiguous.

    norm_weight [D] is Qwen3's q_norm/k_norm (None: rotate only, as Llama does).
    cos_sin_cache [max_position, D] float32 holds cos in its first half, sin in its second;
    row positions[i] rotates token i (neox layout: pairs (x[j], x[j + D/2])).
    """
    if norm_weight is not None:
        x = rms_norm_ref(x, norm_weight, eps)
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)  # each [N, D/2]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # broadcast over heads
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x [N, 2I] = [gate | up] -> silu(gate) * up [N, I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
