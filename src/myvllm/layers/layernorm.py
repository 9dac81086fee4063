"""RMSNorm with an optional fused residual add: forward(x, residual) returns
(rmsnorm(x + residual), x + residual), so the decoder layers pass the residual stream along.
Numerics as HF transformers (kernels/layer_ops_reference.py: rms_norm_ref). Where the next
layer's kernel computes the norm (layers/fused.py), it returns its input and weights instead.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from myvllm.kernels import rms_norm
from myvllm.layers.fused import NormedInput, defer_rms_norm


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))
        # Set by layers/fused.py when one layer reads this norm's output: whether, for input x,
        # that layer's kernel computes the norm itself.
        self.next_layer_fuses: Callable[[torch.Tensor], bool] | None = None

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | NormedInput | tuple[torch.Tensor | NormedInput, torch.Tensor]:
        """rmsnorm(x); with residual, (rmsnorm(x + residual), x + residual)."""
        if self.next_layer_fuses is not None and self.next_layer_fuses(x):
            return defer_rms_norm(x, self.weight, self.eps, residual)
        return rms_norm(x, self.weight, self.eps, residual)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"
