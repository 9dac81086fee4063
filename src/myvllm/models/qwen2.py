"""Qwen2 and Qwen2.5: the shared decoder stack (models/decoder.py) with Qwen2's attention.

Qwen2's attention is Llama's (llama.py) with a bias on q_proj, k_proj and v_proj and none on
o_proj or the MLP; there is no per-head q_norm/k_norm: Qwen3 dropped the bias and added the
norms. head_dim is hidden_size / num_attention_heads (Qwen2.5-0.5B: 896 / 14 = 64). The
configs name a sliding window, but use_sliding_window is false in the released checkpoints
and transformers then attends to the whole sequence, as we do; a config that turns it on is
refused.

    q, k, v = split(qkv_proj(hidden_states))   # W x + b: the packed bias is [b_q | b_k | b_v],
                                               # cut by heads under tensor parallelism
    q, k    = rotary_emb(positions, q, k)      # RoPE
    out     = o_proj(attn(q, k, v))            # no bias
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from myvllm.models.decoder import CausalLM
from myvllm.models.llama import LlamaAttention

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class Qwen2Attention(LlamaAttention):
    def __init__(self, config: PretrainedConfig) -> None:  # a transformers Qwen2Config
        super().__init__(config, bias=True, bias_o_proj=False)


class Qwen2ForCausalLM(CausalLM):
    def __init__(self, config: PretrainedConfig) -> None:
        if getattr(config, "use_sliding_window", False):
            raise ValueError(
                "Qwen2 with use_sliding_window=True is not supported: myvllm attends to the "
                "whole sequence; set use_sliding_window to false in config.json (the released "
                "Qwen2/Qwen2.5 checkpoints have it false)"
            )
        super().__init__(config, Qwen2Attention, mlp_bias=False)
