"""Qwen3 (dense): the shared decoder stack (models/decoder.py) with Qwen3's attention.

What makes it Qwen3 is in the attention: a per-head RMSNorm on q and on k (q_norm, k_norm)
before RoPE. Its MLP has no bias; head_dim is set in the config (Qwen3-0.6B: 128, where
hidden_size / num_attention_heads is 64).

    x, residual = input_layernorm(x, residual)                 # fused into qkv_proj
    q, k, v     = split(qkv_proj(x))
    q, k        = rotary_emb(positions, q, k, q_norm, k_norm)  # per-head RMSNorm, then RoPE:
                                                               # q and k in one kernel on a GPU
    x           = o_proj(attn(q, k, v))

Every hyper-parameter comes from the HF config object.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from myvllm.layers.attention import Attention
from myvllm.layers.fused import norm_linear
from myvllm.layers.layernorm import RMSNorm
from myvllm.layers.linear import QKVParallelLinear, RowParallelLinear
from myvllm.layers.rotary_embedding import get_rope
from myvllm.models.config import get_head_dim, rope_parameters
from myvllm.models.decoder import CausalLM

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class Qwen3Attention(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:  # a transformers Qwen3Config
        super().__init__()
        hidden_size = config.hidden_size
        self.head_dim = get_head_dim(config)
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(
            hidden_size, self.head_dim, config.num_attention_heads, config.num_key_value_heads, bias
        )
        # Heads held by THIS rank (whole heads; see QKVParallelLinear).
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim, hidden_size, bias
        )
        rope_theta, rope_scaling = rope_parameters(config)
        self.rotary_emb = get_rope(
            self.head_dim, config.max_position_embeddings, rope_theta, rope_scaling
        )
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
        norm: RMSNorm,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (attention of norm(x + residual), x + residual); norm: the layer's input_layernorm."""
        qkv, residual = norm_linear(norm, self.qkv_proj, x, residual)
        n = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        q, k = self.rotary_emb(positions, q, k, self.q_norm, self.k_norm)
        o = self.attn(q, k, v)
        return self.o_proj(o), residual


class Qwen3ForCausalLM(CausalLM):
    def __init__(self, config: PretrainedConfig) -> None:
        if getattr(config, "use_sliding_window", False):
            raise ValueError(
                "Qwen3 with use_sliding_window=True is not supported (full attention only)"
            )
        super().__init__(config, Qwen3Attention, mlp_bias=False)
