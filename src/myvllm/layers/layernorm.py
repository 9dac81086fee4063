"""RMSNorm with an optional fused residual add: forward(x, residual) returns
(rmsnorm(x + residual), x + residual), so the decoder layers pass the residual stream along.
Numerics as HF transformers (kernels/reference.py: rms_norm_ref).
"""

from __future__ import annotations

import torch
from torch import nn

from myvllm.kernels import rms_norm


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """rmsnorm(x); with residual, (rmsnorm(x + residual), x + residual)."""
        return rms_norm(x, self.weight, self.eps, residual)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"
