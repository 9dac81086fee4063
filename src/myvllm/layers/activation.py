"""SiLU-and-multiply, the gate of a SwiGLU MLP: x = [gate | up] (one packed matmul) ->
silu(gate) * up. Where down_proj's kernel applies it as it loads its input (layers/fused.py),
it computes nothing and hands gate | up on.
"""

from __future__ import annotations

import torch

from myvllm.kernels import silu_and_mul
from myvllm.layers.fused import FusableOp, GatedInput


class SiluAndMul(FusableOp):
    def forward(self, x: torch.Tensor) -> torch.Tensor | GatedInput:
        if self.defers_to_next_layer(x):  # down_proj's kernel applies it
            return GatedInput(x)
        return silu_and_mul(x)
