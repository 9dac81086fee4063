"""Llama (Llama-2/3.x, SmolLM2, ...), built from the tensor-parallel layers.

This file is the guide's exercise: delete it and write it back; tests/models/test_llama_exercise.py
grades the result against HF transformers' LlamaForCausalLM.

Compared with qwen3.py: no per-head q_norm/k_norm; head_dim is config.head_dim when present
(else hidden_size / num_attention_heads); the attention projections carry a bias when
config.attention_bias, the MLP when config.mlp_bias; Llama-3.1/3.2 use the "llama3" RoPE
scaling, read from the config like the plain rope_theta.

Names equal the checkpoint's; q/k/v_proj and gate/up_proj are packed (packed_modules_mapping):

    model.embed_tokens                 VocabParallelEmbedding
    model.layers.N.input_layernorm     RMSNorm
    model.layers.N.self_attn.qkv_proj  QKVParallelLinear   <- q_proj, k_proj, v_proj
    model.layers.N.self_attn.o_proj    RowParallelLinear
    model.layers.N.post_attention_layernorm
    model.layers.N.mlp.gate_up_proj    MergedColumnParallelLinear <- gate_proj, up_proj
    model.layers.N.mlp.down_proj       RowParallelLinear
    model.norm, lm_head                (lm_head shares embed_tokens' weight when tied)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from myvllm.layers.activation import SiluAndMul
from myvllm.layers.attention import Attention
from myvllm.layers.embedding_head import ParallelLMHead, VocabParallelEmbedding
from myvllm.layers.fused import norm_linear, silu_and_mul_linear
from myvllm.layers.layernorm import RMSNorm
from myvllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from myvllm.layers.rotary_embedding import get_rope
from myvllm.utils.loader import get_head_dim, rope_parameters

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class LlamaAttention(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:  # a transformers LlamaConfig
        super().__init__()
        hidden_size = config.hidden_size
        self.head_dim = get_head_dim(config)
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(
            hidden_size, self.head_dim, config.num_attention_heads, config.num_key_value_heads, bias
        )
        self.num_heads = self.qkv_proj.num_heads  # this rank's share
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

    def forward(self, positions: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
        """qkv = qkv_proj(input_layernorm(x)): the decoder layer runs it (layers/fused.py)."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class LlamaMLP(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"LlamaMLP supports hidden_act='silu' only, got {config.hidden_act!r}")
        bias = bool(getattr(config, "mlp_bias", False))
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [config.intermediate_size] * 2, bias=bias
        )
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, bias=bias)
        self.act_fn = SiluAndMul()

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up = gate_up_proj(post_attention_layernorm(x)), which the decoder layer runs
        (fused where it can: layers/fused.py)."""
        return silu_and_mul_linear(self.act_fn, self.down_proj, gate_up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Each RMSNorm runs inside the matmul after it where that is a skinny_gemm (a decode
        # batch of one row on a GPU), else as its own kernel: layers/fused.py.
        qkv, residual = norm_linear(self.input_layernorm, self.self_attn.qkv_proj,
                                    hidden_states, residual)
        hidden_states = self.self_attn(positions, qkv)
        gate_up, residual = norm_linear(self.post_attention_layernorm, self.mlp.gate_up_proj,
                                        hidden_states, residual)
        return self.mlp(gate_up), residual


class LlamaModel(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [LlamaDecoderLayer(config) for _ in range(config.num_hidden_layers)]
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.lm_head(hidden_states)
