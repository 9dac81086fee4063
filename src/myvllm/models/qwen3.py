"""Qwen3 (dense): the shared decoder stack with Qwen3's attention, whose per-head q_norm and
k_norm run before RoPE (one kernel with it on a GPU, layers/fused.py). Every hyper-parameter
comes from the HF config.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from myvllm.layers.attention import Attention
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
        self.qkv_proj = QKVParallelLinear(hidden_size, self.head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, bias)
        # Heads held by THIS rank (whole heads; see QKVParallelLinear).
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim, hidden_size, bias
        )
        rope_theta, rope_scaling = rope_parameters(config)
        self.rotary_emb = get_rope(self.head_dim, config.max_position_embeddings, rope_theta,
                                   rope_scaling)
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        # The norms see one head at a time: [tokens, heads, head_dim].
        q = self.q_norm(q.view(-1, self.num_heads, self.head_dim))
        k = self.k_norm(k.view(-1, self.num_kv_heads, self.head_dim))
        q, k = self.rotary_emb(positions, q, k)
        o = self.attn(q, k, v)
        return self.o_proj(o)


class Qwen3ForCausalLM(CausalLM):
    def __init__(self, config: PretrainedConfig) -> None:
        if getattr(config, "use_sliding_window", False):
            raise ValueError("Qwen3 with use_sliding_window=True is not supported "
                             "(full attention only)")
        super().__init__(config, Qwen3Attention, mlp_bias=False)
