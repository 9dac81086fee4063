"""SiLU-and-multiply: the gate of a SwiGLU MLP.

The MLP's gate_proj and up_proj run as ONE matmul (MergedColumnParallelLinear), so its
output is the two halves side by side:

    x = [ gate (I) | up (I) ]   ->   silu(gate) * up   (I)

Splitting here, instead of running two matmuls, saves a kernel launch and a read of the
input per layer. On the GPU the split, the SiLU and the multiply are one Triton kernel
(kernels/layer_ops_triton.py); on the CPU the PyTorch reference runs.
"""

from __future__ import annotations

import torch
from torch import nn

from myvllm.kernels import silu_and_mul


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)
