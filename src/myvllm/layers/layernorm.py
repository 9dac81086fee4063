"""RMSNorm with an optional fused residual add.

A pre-norm decoder layer does, twice per layer:

    residual = residual + x          # the residual stream
    x        = rmsnorm(residual)     # what the next block sees

Doing both in one call (``forward(x, residual)``) keeps that bookkeeping out of the decoder
layers; it returns both the normalised tensor and the new residual stream. On the GPU both
steps are one Triton kernel, a single pass over memory (kernels/layer_ops_triton.py); on the
CPU the PyTorch reference runs (kernels/layer_ops_reference.py: rms_norm_ref). Where the
layer after the norm can compute it inside its own kernel (a GPU, layers/fused.py), the norm
computes nothing and returns its input and weights for that kernel.

Numerics follow HF transformers: the sum is rounded to the model dtype (that rounded value
IS the residual stream), the norm is computed in float32, cast back, then scaled by the
weight in the model dtype.
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
