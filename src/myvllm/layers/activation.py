"""SiLU-and-multiply, the gate of a SwiGLU MLP: x = [gate | up] (one packed matmul) ->
silu(gate) * up.
"""

from __future__ import annotations

import torch
from torch import nn

from myvllm.kernels import silu_and_mul


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)
