"""Attention over the paged KV cache: no weights; it stores this step's k, v through
slot_mapping, then routes q to a kernel by the step's context (attend):

    prefill, no cached prefix   flash_attention_varlen over k, v
    prefill, cached prefix      flash_attention_varlen over the cache, through block_tables
                                (layers/paged_prefill.py)
    decode                      paged_attention_decode over the cache

k_cache/v_cache stay empty until the ModelRunner points them at this layer's views of the
cache (nothing is stored then). An fp8 cache holds K / k_scale and V / v_scale (the guide's
Features, "An fp8 KV cache"). On a GPU the RoPE kernel stores k and v as it rotates k
(layers/fused.py).
"""

from __future__ import annotations

import torch
from torch import nn

from myvllm.kernels import flash_attention_varlen, paged_attention_decode, store_kvcache
from myvllm.layers.paged_prefill import paged_prefill
from myvllm.utils.context import Context, get_context


class Attention(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int) -> None:
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads={num_heads} must be a multiple of "
                             f"num_kv_heads={num_kv_heads} (GQA)")
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.k_cache = torch.tensor([])
        self.v_cache = torch.tensor([])
        # fp8 cache only: stored = K / k_scale (vLLM's _k_scale / _v_scale, per layer).
        # Plain floats, passed to the kernels by value: a CUDA graph keeps the values it was
        # captured with, so they are fixed before the runner's warm-up.
        self.k_scale = 1.0
        self.v_scale = 1.0

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [N, Hq*D] or [N, Hq, D]; k, v [N, Hkv*D] or [N, Hkv, D] -> o [N, Hq*D]."""
        context = get_context()
        n = v.shape[0]
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        if self.k_cache.numel() > 0 and context.slot_mapping is not None:
            store_kvcache(k, v, self.k_cache, self.v_cache, context.slot_mapping,
                          self.k_scale, self.v_scale)
        return self.attend(q, k, v, context)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               context: Context) -> torch.Tensor:
        """q [N, Hq, D], k, v [N, Hkv, D], already in the cache if there is one -> o [N, Hq*D]."""
        n = q.shape[0]
        has_cache = self.k_cache.numel() > 0
        if context.is_prefill:
            if context.cu_seqlens_q is None or context.cu_seqlens_k is None:
                raise RuntimeError("Attention in prefill needs cu_seqlens_q/cu_seqlens_k in the "
                                   "context; run the model inside forward_context(...)")
            if context.block_tables is None:
                o = flash_attention_varlen(q, k, v, context.cu_seqlens_q, context.cu_seqlens_k,
                                           context.max_seqlen_q, context.max_seqlen_k, self.scale)
            elif not has_cache:
                raise RuntimeError("prefill with block_tables (cached prefix) needs a KV cache")
            else:  # a cached prefix: every K/V read from the cache, through block_tables
                o = paged_prefill(self, q, k, v, context, context.cu_seqlens_q,
                                  context.cu_seqlens_k)
        else:
            if context.block_tables is None or context.context_lens is None or not has_cache:
                raise RuntimeError("Attention in decode needs a KV cache plus block_tables and "
                                   "context_lens in the context; run the model inside "
                                   "forward_context(...)")
            o = paged_attention_decode(q, self.k_cache, self.v_cache, context.block_tables,
                                       context.context_lens, self.scale, self.k_scale, self.v_scale)
        return o.reshape(n, self.num_heads * self.head_dim)

    def extra_repr(self) -> str:
        return (
            f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, scale={self.scale:.4g}"
        )
