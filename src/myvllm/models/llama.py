"""Llama (Llama-2/3.x, SmolLM2, ...): the shared decoder stack (models/decoder.py) with
Llama's attention.

This file is the guide's exercise: delete it and write it back; tests/models/test_llama_exercise.py
grades the result against HF transformers' LlamaForCausalLM.

Compared with qwen3.py: no per-head q_norm/k_norm; head_dim is config.head_dim when present
(else hidden_size / num_attention_heads); the attention projections carry a bias when
config.attention_bias, the MLP when config.mlp_bias; Llama-3.1/3.2 use the "llama3" RoPE
scaling, read from the config like the plain rope_theta. Qwen2's attention is this one with
a bias on q, k and v only (qwen2.py).

    q, k, v = split(qkv_proj(hidden_states))   # this rank's heads: grouped-query attention,
                                               # fewer k/v heads than q heads
    q, k    = rotary_emb(positions, q, k)      # RoPE, scaled as the config says
    out     = o_proj(attn(q, k, v))
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


class LlamaAttention(nn.Module):
    def __init__(self, config: PretrainedConfig, bias: bool | None = None,
                 bias_o_proj: bool | None = None) -> None:  # fmt: skip
        """config: a transformers LlamaConfig. bias, bias_o_proj: whether qkv_proj and o_proj
        carry a bias (vLLM's names); both default to config.attention_bias."""
        super().__init__()
        hidden_size = config.hidden_size
        self.head_dim = get_head_dim(config)
        attention_bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(
            hidden_size, self.head_dim, config.num_attention_heads, config.num_key_value_heads,
            attention_bias if bias is None else bias,
        )
        self.num_heads = self.qkv_proj.num_heads  # this rank's share
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim, hidden_size,
            attention_bias if bias_o_proj is None else bias_o_proj,
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


class LlamaForCausalLM(CausalLM):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__(config, LlamaAttention, mlp_bias=bool(getattr(config, "mlp_bias", False)))
