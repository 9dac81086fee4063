"""The Triton side of the kernels' dispatch (kernels/__init__.py): each public kernel calls
here when use_triton says so. The Triton modules are imported at the first call, so that a
machine without Triton (or a CPU run) never loads them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from . import batch_invariant

if TYPE_CHECKING:
    from .tile_map import TileMap


def store_kvcache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slot_mapping: torch.Tensor, k_scale: float,
                  v_scale: float) -> None:
    from . import store_kvcache_kernel as triton_impl

    triton_impl.store_kvcache_triton(key, value, k_cache, v_cache, slot_mapping,
                                     k_scale, v_scale)


def flash_attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                           max_seqlen_q: int, max_seqlen_k: int, scale: float,
                           block_tables: torch.Tensor | None, k_cache: torch.Tensor | None,
                           v_cache: torch.Tensor | None, tile_map: TileMap | None,
                           out: torch.Tensor | None, k_scale: float, v_scale: float
                           ) -> torch.Tensor:
    from . import prefill_attention as triton_impl

    return triton_impl.flash_attention_varlen_triton(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, block_tables,
        k_cache, v_cache, tile_map, out, batch_invariant=batch_invariant.enabled,
        k_scale=k_scale, v_scale=v_scale)


def paged_attention_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           scale: float, k_scale: float, v_scale: float) -> torch.Tensor:
    """In batch-invariant mode a decode row goes through the prefill kernel, whose reduction
    order does not depend on the batch (kernels/batch_invariant.py)."""
    if batch_invariant.enabled:
        from . import prefill_attention

        return prefill_attention.decode_with_prefill_kernel(
            q, k_cache, v_cache, block_tables, context_lens, scale, k_scale, v_scale)
    from . import decode_attention as triton_impl

    return triton_impl.paged_attention_decode_triton(
        q, k_cache, v_cache, block_tables, context_lens, scale,
        k_scale=k_scale, v_scale=v_scale,
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    from . import layer_ops_triton as triton_impl

    return triton_impl.rms_norm_triton(x, weight, eps, residual)


def norm_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
              cos_sin_cache: torch.Tensor, q_norm_weight: torch.Tensor | None,
              k_norm_weight: torch.Tensor | None, eps: float
              ) -> tuple[torch.Tensor, torch.Tensor]:
    from . import layer_ops_triton as triton_impl

    return triton_impl.norm_rope_triton(q, k, positions, cos_sin_cache, q_norm_weight,
                                        k_norm_weight, eps)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    from . import layer_ops_triton as triton_impl

    return triton_impl.silu_and_mul_triton(x)
