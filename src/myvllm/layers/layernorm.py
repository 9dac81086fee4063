"""RMSNorm with an optional fused residual add.

A pre-norm decoder layer does, twice per layer:

    residual = residual + x          # the residual stream
    x        = rmsnorm(residual)     # what the next block sees

Doing both in one call (``forward(x, residual)``) keeps that bookkeeping out of the decoder
layers; it returns both the normalised tensor and the new residual stream. (Here it is still a
handful of PyTorch ops; a fused kernel would make it one pass over memory.)

Numerics follow HF transformers: the sum is rounded to the model dtype (that rounded value
IS the residual stream), the norm is computed in float32, cast back, then scaled by the
weight in the model dtype.
"""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        variance = x32.pow(2).mean(dim=-1, keepdim=True)
        return (x32 * torch.rsqrt(variance + self.eps)).to(dtype) * self.weight

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self._norm(x)
        # The add happens in float32 and is rounded once, like HF's `residual + hidden`.
        new_residual = (x.float() + residual.float()).to(x.dtype)
        return self._norm(new_residual), new_residual

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"
