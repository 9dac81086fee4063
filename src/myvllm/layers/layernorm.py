"""RMSNorm with an optional fused residual add.

A pre-norm decoder layer does, twice per layer:

    residual = residual + x          # the residual stream
    x        = rmsnorm(residual)     # what the next block sees

Doing both in one call (``forward(x, residual)``) keeps that bookkeeping out of the decoder
layers; it returns both the normalised tensor and the new residual stream. On the GPU both
steps are one Triton kernel, a single pass over memory (kernels/layer_ops_triton.py); on the
CPU the PyTorch reference runs (kernels/layer_ops_reference.py: rms_norm_ref).

Numerics follow HF transformers: the sum is rounded to the model dtype (that rounded value
IS the residual stream), the norm is computed in float32, cast back, then scaled by the
weight in the model dtype.
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
        return rms_norm(x, self.weight, self.eps, residual)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"
