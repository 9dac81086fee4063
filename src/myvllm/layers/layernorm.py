"""RMSNorm with an optional fused residual add: forward(x, residual) returns
(rmsnorm(x + residual), x + residual), so the decoder layers pass the residual stream along.
Numerics as HF transformers (kernels/layer_ops_reference.py: rms_norm_ref). Where the next
layer's kernel computes the norm (layers/fused.py), it returns its input and weights instead.
"""

from __future__ import annotations

import torch
from torch import nn

from myvllm.kernels import rms_norm
from myvllm.layers.fused import FusableOp, NormedInput, defer_rms_norm


class RMSNorm(FusableOp):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | NormedInput | tuple[torch.Tensor | NormedInput, torch.Tensor]:
        """rmsnorm(x); with residual, (rmsnorm(x + residual), x + residual)."""
        if self.defers_to_next_layer(x):  # the next layer's kernel computes the norm
            return defer_rms_norm(x, self.weight, self.eps, residual)
        return rms_norm(x, self.weight, self.eps, residual)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"
