"""SiLU-and-multiply: the gate of a SwiGLU MLP.

The MLP's gate_proj and up_proj run as ONE matmul (MergedColumnParallelLinear), so its
output is the two halves side by side:

    x = [ gate (I) | up (I) ]   ->   silu(gate) * up   (I)

Splitting here, instead of running two matmuls, saves a kernel launch and a read of the
input per layer. On the GPU the split, the SiLU and the multiply are one Triton kernel
(kernels/layer_ops_triton.py); on the CPU the PyTorch reference runs. Where down_proj's
kernel can apply it as it loads its input (a GPU, 1-4 rows: layers/fused.py), SiluAndMul
computes nothing and hands gate | up to that kernel.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from myvllm.kernels import silu_and_mul
from myvllm.layers.fused import GatedInput


class SiluAndMul(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # Set by layers/fused.py: whether, for input x, down_proj's kernel applies this op.
        self.next_layer_fuses: Callable[[torch.Tensor], bool] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor | GatedInput:
        if self.next_layer_fuses is not None and self.next_layer_fuses(x):
            return GatedInput(x)
        return silu_and_mul(x)
