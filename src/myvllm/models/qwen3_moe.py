"""Qwen3-MoE (Qwen3-30B-A3B, ...): Qwen3's attention, and experts in place of most MLPs.

Each sparse layer's MLP is a router and E experts (layers/fused_moe.py); per token, only the
k experts the router picks run (Qwen3-30B-A3B: 8 of 128, each with intermediate size 768, so
3B of the 30B parameters are active):

    x, residual   = post_attention_layernorm(x, residual)
    router_logits = gate(x)                                   # [M, E], replicated linear
    x             = experts(x, router_logits)                 # softmax, top-k, fused_moe

A layer is sparse as transformers decides: not in config.mlp_only_layers, and (index + 1) a
multiple of config.decoder_sparse_step; the other layers keep a dense GatedMLP of
config.intermediate_size. Checkpoint names: mlp.gate.weight (the router),
mlp.experts.<e>.{gate,up,down}_proj.weight (loaded into the stacked experts).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from myvllm.layers.fused_moe import EXPERT_PARAMS_MAPPING, FusedMoE
from myvllm.layers.linear import ReplicatedLinear
from myvllm.models.decoder import CausalLM, GatedMLP
from myvllm.models.qwen3 import Qwen3Attention

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def is_sparse_layer(config: PretrainedConfig, layer_index: int) -> bool:
    """transformers' Qwen3MoeDecoderLayer rule for a layer that has experts."""
    return (layer_index not in (getattr(config, "mlp_only_layers", None) or [])
            and config.num_experts > 0
            and (layer_index + 1) % config.decoder_sparse_step == 0)  # fmt: skip


class Qwen3MoeSparseMoeBlock(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"Qwen3-MoE experts support hidden_act='silu' only, "
                             f"got {config.hidden_act!r}")  # fmt: skip
        self.gate = ReplicatedLinear(config.hidden_size, config.num_experts)
        self.experts = FusedMoE(config.num_experts, config.num_experts_per_tok,
                                config.hidden_size, config.moe_intermediate_size,
                                renormalize=bool(config.norm_topk_prob))  # fmt: skip

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        router_logits = self.gate(hidden_states)
        return self.experts(hidden_states, router_logits)


class Qwen3MoeForCausalLM(CausalLM):
    expert_params_mapping = EXPERT_PARAMS_MAPPING

    def __init__(self, config: PretrainedConfig) -> None:
        if getattr(config, "use_sliding_window", False):
            raise ValueError(
                "Qwen3-MoE with use_sliding_window=True is not supported (full attention only)"
            )
        super().__init__(config, Qwen3Attention, mlp=lambda config, i: (
            Qwen3MoeSparseMoeBlock(config) if is_sparse_layer(config, i)
            else GatedMLP(config, bias=False)))  # fmt: skip
