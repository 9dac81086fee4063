"""Qwen2 and Qwen2.5: the shared decoder stack (models/decoder.py) with Qwen2's attention.

Compared with qwen3.py: q_proj, k_proj and v_proj carry a bias (o_proj and the MLP do not),
and there is no per-head q_norm/k_norm; Qwen3 dropped the bias and added the norms. head_dim
is hidden_size / num_attention_heads (Qwen2.5-0.5B: 896 / 14 = 64). The configs name a
sliding window, but use_sliding_window is false in the released checkpoints and transformers
then attends to the whole sequence, as we do; a config that turns it on is refused.

    q, k, v = split(qkv_proj(hidden_states))   # W x + b: the packed bias is [b_q | b_k | b_v],
                                               # cut by heads under tensor parallelism
    q, k    = rotary_emb(positions, q, k)      # RoPE
    out     = o_proj(attn(q, k, v))            # no bias
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from myvllm.layers.attention import Attention
from myvllm.layers.linear import QKVParallelLinear, RowParallelLinear
from myvllm.layers.rotary_embedding import get_rope
from myvllm.models.config import get_head_dim, rope_parameters
from myvllm.models.decoder import CausalLM

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class Qwen2Attention(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:  # a transformers Qwen2Config
        super().__init__()
        hidden_size = config.hidden_size
        self.head_dim = get_head_dim(config)
        self.qkv_proj = QKVParallelLinear(
            hidden_size, self.head_dim, config.num_attention_heads, config.num_key_value_heads,
            bias=True,
        )
        self.num_heads = self.qkv_proj.num_heads  # this rank's share
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim, hidden_size, bias=False
        )
        rope_theta, rope_scaling = rope_parameters(config)
        self.rotary_emb = get_rope(
            self.head_dim, config.max_position_embeddings, rope_theta, rope_scaling
        )
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        o = self.attn(q, k, v)
        return self.o_proj(o)


class Qwen2ForCausalLM(CausalLM):
    def __init__(self, config: PretrainedConfig) -> None:
        if getattr(config, "use_sliding_window", False):
            raise ValueError(
                "Qwen2 with use_sliding_window=True is not supported: myvllm attends to the "
                "whole sequence; set use_sliding_window to false in config.json (the released "
                "Qwen2/Qwen2.5 checkpoints have it false)"
            )
        super().__init__(config, Qwen2Attention, mlp_bias=False)
