"""Rotary position embedding (RoPE), the neox / half-rotation layout of HF Qwen3 and Llama:
pair (x[i], x[i + D/2]) of each head turns by position * inv_freq[i], the position absolute
(a cached prefix's new tokens start at num_cached_tokens). kernels.norm_rope rotates (on a GPU
it also takes Qwen3's q_norm/k_norm into the same kernel: layers/fused.py); the frequencies
are in layers/rope_scaling.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from myvllm.kernels import norm_rope
from myvllm.layers.rope_scaling import cos_sin_table


class RotaryEmbedding(nn.Module):
    cos_sin_cache: torch.Tensor  # a buffer, registered in __init__

    def __init__(self, head_dim: int, max_position: int, cos_sin_cache: torch.Tensor) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_position = max_position
        # Not persistent: it is derived from the config, not a checkpoint tensor.
        self.register_buffer("cos_sin_cache", cos_sin_cache, persistent=False)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], *args: Any,
               **kwargs: Any) -> RotaryEmbedding:
        # The rotation runs in float32 whatever the model dtype; model.to(torch.bfloat16) must
        # not round the cos/sin table (8 mantissa bits), so it only follows device moves.
        cache = self.cos_sin_cache
        super()._apply(fn, *args, **kwargs)
        if self.cos_sin_cache.dtype != torch.float32:
            self.cos_sin_cache = cache.to(device=self.cos_sin_cache.device)
        return self

    def forward(self, positions: torch.Tensor, q: torch.Tensor,
                k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [N]; q [N, Hq, D], k [N, Hkv, D] (or flat [N, H*D]) -> rotated, same shapes."""
        n = positions.shape[0]
        q_out, k_out = norm_rope(q.view(n, -1, self.head_dim), k.view(n, -1, self.head_dim),
                                 positions, self.cos_sin_cache)  # fmt: skip
        return q_out.view(q.shape), k_out.view(k.shape)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, max_position={self.max_position}"


def get_rope(
    head_dim: int, max_position: int, base: float, rope_scaling: dict | None = None
) -> RotaryEmbedding:
    """A RoPE module for these settings; every layer's holds the SAME cos/sin table (one per
    layer would be 560 MB for Qwen3-0.6B), cached per default device. model.to(...) gives that
    model's modules a new tensor and leaves the cached table alone."""
    table = cos_sin_table(int(head_dim), int(max_position), float(base), rope_scaling)
    return RotaryEmbedding(int(head_dim), int(max_position), table)
