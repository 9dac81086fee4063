"""The decoder stack every model shares; each model file brings its attention (Qwen3-MoE its
MLP too). Module names equal the checkpoint's, except the packed matmuls
(packed_modules_mapping): qkv_proj <- q/k/v_proj, gate_up_proj <- gate/up_proj.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from myvllm.layers.activation import SiluAndMul
from myvllm.layers.embedding_head import ParallelLMHead, VocabParallelEmbedding
from myvllm.layers.layernorm import RMSNorm
from myvllm.layers.linear import MergedColumnParallelLinear, RowParallelLinear

if TYPE_CHECKING:
    from transformers import PretrainedConfig

AttentionFactory = Callable[["PretrainedConfig"], nn.Module]
MLPFactory = Callable[["PretrainedConfig", int], nn.Module]  # (config, layer index)


class GatedMLP(nn.Module):
    """down_proj(silu(gate) * up), with gate and up from one packed matmul."""

    def __init__(self, config: PretrainedConfig, bias: bool) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"GatedMLP supports hidden_act='silu' only, got {config.hidden_act!r}")
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size,
                                                       [config.intermediate_size] * 2, bias=bias)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, bias=bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        x = self.act_fn(gate_up)
        return self.down_proj(x)


class DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, attention: AttentionFactory, mlp: nn.Module
                 ) -> None:  # fmt: skip
        super().__init__()
        self.self_attn = attention(config)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (the MLP's output, the residual stream it adds to): their sum is transformers'
        layer output; the next layer's input_layernorm (or model.norm) adds them."""
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        hidden_states = self.mlp(hidden_states)
        return hidden_states, residual


class DecoderModel(nn.Module):
    def __init__(self, config: PretrainedConfig, attention: AttentionFactory, mlp: MLPFactory
                 ) -> None:  # fmt: skip
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(config, attention, mlp(config, i))
                                     for i in range(config.num_hidden_layers)])  # fmt: skip
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class CausalLM(nn.Module):
    """A decoder stack with its LM head; a model subclasses it and names its attention."""

    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: PretrainedConfig, attention: AttentionFactory,
                 mlp_bias: bool = False, mlp: MLPFactory | None = None) -> None:
        """mlp: the MLP of each layer (default: GatedMLP, with a bias when mlp_bias)."""
        super().__init__()
        self.config = config
        self.model = DecoderModel(config, attention,
                                  mlp or (lambda config, _: GatedMLP(config, mlp_bias)))
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
