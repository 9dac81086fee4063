"""The decoder stack that every model shares; each model file brings its own attention (and
Qwen3-MoE its own MLP).

Module names equal the checkpoint's tensor names, except for the two packed matmuls, which
``packed_modules_mapping`` tells the loader about:

    CausalLM
      model                              DecoderModel
        embed_tokens                     VocabParallelEmbedding
        layers.N                         DecoderLayer
          input_layernorm                RMSNorm
          self_attn                      the model's attention (qwen3.py, llama.py, qwen2.py)
            qkv_proj                     QKVParallelLinear   <- q_proj, k_proj, v_proj
          post_attention_layernorm       RMSNorm
          mlp                            GatedMLP, or the model's own (Qwen3-MoE's experts)
            gate_up_proj                 MergedColumnParallelLinear <- gate_proj, up_proj
            down_proj                    RowParallelLinear
        norm                             RMSNorm
      lm_head                            ParallelLMHead (embed_tokens' weight when tied)

One decoder layer, pre-norm, with the residual add fused into the next RMSNorm:

    x, residual = self_attn(positions, x, residual, input_layernorm)
    x, residual = mlp(x, residual, post_attention_layernorm)

Each norm is the layer's (that is its name in the checkpoint) but runs inside the module whose
matmul follows it: the attention runs input_layernorm with its qkv_proj, the MLP runs
post_attention_layernorm with its gate_up_proj and SiLU-and-mul with its down_proj
(layers/fused.py). At decode batch 1 on a GPU each pair is one kernel; elsewhere the two run
one after the other, so the math is the unfused layers'.

The attention a model brings is built from the config, ``attention(config)``, and runs
``forward(positions, x, residual, norm) -> (out, residual)``, where residual is None in the
first layer. The MLP is GatedMLP unless the model brings one per layer, ``mlp(config,
layer_index)``, which runs ``forward(x, residual, norm) -> (out, residual)`` like GatedMLP.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from myvllm.layers.activation import SiluAndMul
from myvllm.layers.embedding_head import ParallelLMHead, VocabParallelEmbedding
from myvllm.layers.fused import norm_linear, silu_and_mul_linear
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
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [config.intermediate_size] * 2, bias=bias
        )
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, bias=bias)
        self.act_fn = SiluAndMul()

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (the MLP of norm(x + residual), x + residual): the output and the residual stream."""
        gate_up, residual = norm_linear(norm, self.gate_up_proj, x, residual)
        return silu_and_mul_linear(self.act_fn, self.down_proj, gate_up), residual


class DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, attention: AttentionFactory, mlp: nn.Module
                 ) -> None:  # fmt: skip
        super().__init__()
        self.self_attn = attention(config)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden_states, residual = self.self_attn(
            positions, hidden_states, residual, self.input_layernorm
        )
        return self.mlp(hidden_states, residual, self.post_attention_layernorm)


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

    def __init__(
        self, config: PretrainedConfig, attention: AttentionFactory, mlp_bias: bool = False,
        mlp: MLPFactory | None = None,
    ) -> None:
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
