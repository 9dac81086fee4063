"""SiLU-and-multiply: the gate of a SwiGLU MLP.

The MLP's gate_proj and up_proj run as ONE matmul (MergedColumnParallelLinear), so its
output is the two halves side by side:

    x = [ gate (I) | up (I) ]   ->   silu(gate) * up   (I)

Splitting here, instead of running two matmuls, saves a kernel launch and a read of the
input per layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
