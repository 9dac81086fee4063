"""Prefill attention over a cached prefix (Attention.forward, when the step has block_tables):
all of each sequence's K/V, the prefix and the new tokens it just stored, read from the paged
cache. On a GPU a padded chunked step (worker/padded_steps.py) also hands the prefill kernel
its query tiles (context.q_tiles) and sends its one-token rows (context.decode_rows) to the
decode kernel instead: a prefill tile of 128 query rows would compute 127 for nothing.
"""

from __future__ import annotations

from typing import Protocol

import torch

from myvllm.kernels import flash_attention_varlen, paged_attention_decode
from myvllm.utils.context import Context


class PagedCache(Protocol):
    """What paged_prefill reads of the attention layer (layers/attention.py): its paged cache,
    the fp8 cache's scales and the softmax scale."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    scale: float
    k_scale: float
    v_scale: float


def paged_prefill(attn: PagedCache, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  context: Context, cu_seqlens_q: torch.Tensor,
                  cu_seqlens_k: torch.Tensor) -> torch.Tensor:
    """q [N, Hq, D] (k, v [N, Hkv, D], already in the cache) -> o [N, Hq, D]. cu_seqlens_q/k
    are the context's, which the caller checked are set."""
    n = q.shape[0]
    rows = context.decode_rows
    # With decode rows, one spare output row takes the padding rows' results.
    o_all = torch.empty(n + (rows is not None), *q.shape[1:], dtype=q.dtype, device=q.device)
    o = flash_attention_varlen(
        q, k, v,
        cu_seqlens_q, cu_seqlens_k,
        context.max_seqlen_q, context.max_seqlen_k, attn.scale,
        block_tables=context.block_tables, k_cache=attn.k_cache, v_cache=attn.v_cache,
        tile_map=context.q_tiles, out=o_all[:n],
        k_scale=attn.k_scale, v_scale=attn.v_scale,
    )  # fmt: skip
    if rows is not None:
        o_rows = paged_attention_decode(
            q.index_select(0, rows.gather), attn.k_cache, attn.v_cache, rows.block_tables,
            rows.context_lens, attn.scale, attn.k_scale, attn.v_scale)
        o = o_all.index_copy_(0, rows.scatter, o_rows)[:n]
    return o
