"""SiLU-and-multiply, the gate of a SwiGLU MLP: x = [gate | up] (one packed matmul) ->
silu(gate) * up. Where down_proj's kernel applies it as it loads its input (layers/fused.py),
it computes nothing and hands gate | up on.
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
