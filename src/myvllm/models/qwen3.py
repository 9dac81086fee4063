"""Qwen3 (dense), built from the tensor-parallel layers.

Module names equal the checkpoint's tensor names (model.layers.N.self_attn.q_norm ...), except
for the two packed matmuls, which ``packed_modules_mapping`` tells the loader about:

    checkpoint                         this model
    self_attn.{q,k,v}_proj.weight  ->  self_attn.qkv_proj.weight    (shard "q" / "k" / "v")
    mlp.{gate,up}_proj.weight      ->  mlp.gate_up_proj.weight      (shard 0 / 1)

One decoder layer (pre-norm; the residual add is fused into the next RMSNorm):

    x, residual = input_layernorm(x, residual)
    q, k, v     = split(qkv_proj(x))
    q, k        = rope(positions, q, k, q_norm, k_norm)   # per-head RMSNorm (Qwen3 only),
                                                          # then RoPE: one kernel on GPU
    x           = o_proj(attention(q, k, v))
    x, residual = post_attention_layernorm(x, residual)
    x           = down_proj(silu(gate) * up)   # gate, up = gate_up_proj(x)

At decode batch 1 on a GPU each RMSNorm runs inside the matmul after it, and silu(gate) * up
inside down_proj (layers/fused.py): the same math in fewer kernel launches.

Every hyper-parameter comes from the HF config object.
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

    def forward(self, positions: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
        """qkv = qkv_proj(input_layernorm(x)), which the decoder layer runs (fused where it
        can: layers/fused.py)."""
        n = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        # Per-head RMSNorm (Qwen3), then RoPE: one fused kernel per tensor on the GPU.
        q, k = self.rotary_emb(positions, q, k, self.q_norm, self.k_norm)
        o = self.attn(q, k, v)
        return self.o_proj(o)


class Qwen3MLP(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"Qwen3MLP supports hidden_act='silu' only, got {config.hidden_act!r}")
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [config.intermediate_size] * 2, bias=False
        )
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, bias=False)
        self.act_fn = SiluAndMul()

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up = gate_up_proj(post_attention_layernorm(x)), which the decoder layer runs
        (fused where it can: layers/fused.py)."""
        return silu_and_mul_linear(self.act_fn, self.down_proj, gate_up)


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.self_attn = Qwen3Attention(config)
        self.mlp = Qwen3MLP(config)
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


class Qwen3Model(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        if getattr(config, "use_sliding_window", False):
            raise ValueError(
                "Qwen3 with use_sliding_window=True is not supported (full attention only)"
            )
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [Qwen3DecoderLayer(config) for _ in range(config.num_hidden_layers)]
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class Qwen3ForCausalLM(nn.Module):
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
        self.model = Qwen3Model(config)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if getattr(config, "tie_word_embeddings", False):
            # One Parameter, two uses: the checkpoint then has no lm_head.weight.
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids [N], positions [N] (all sequences' new tokens, flat) -> hidden [N, H]."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """-> logits [rows, vocab] on TP rank 0 (prefill: last token per sequence), else None."""
        return self.lm_head(hidden_states)
