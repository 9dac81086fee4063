"""Triton kernel: write this step's new K/V rows into the paged KV cache.

One program per token. The token's K (and V) for all kv heads is one [Hkv * D] row, loaded
flat and stored to its slot:

    key[i]  (Hkv*D values)  --->  k_cache[slot // block_size, slot % block_size]  (Hkv*D values)

slot -1 marks a padding token (CUDA-graph batches are padded up to a captured size): that
program writes nothing. The slot is read on the device, so the launch needs no host sync.
An fp8 cache stores key / k_scale and value / v_scale, rounded to fp8 (fp8_kv.quantize_kv).

Where RoPE runs right before it (every model here, on a GPU with a cache: layers/fused.py),
the rotary kernel does this store itself (layer_ops_triton.norm_rope_store_kvcache_triton)
and this kernel is not launched.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fp8_kv import quantize_kv
from .pdl import pdl_args, pdl_wait


@triton.jit
def _store_kvcache_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    k_scale,  # fp8 cache: stored = key / k_scale (unused for other caches)
    v_scale,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    stride_cb,  # cache strides: block, slot-in-block, head (head_dim is contiguous)
    stride_cs,
    stride_ch,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block (power of two -> // and % are shifts)
    HEAD_DIM: tl.constexpr,
    BLOCK_HD: tl.constexpr,  # next power of two >= num_kv_heads * head_dim
    ROW: tl.constexpr,  # num_kv_heads * head_dim
    USE_PDL: tl.constexpr,  # kernels/pdl.py
):
    pdl_wait(USE_PDL)
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    offs = tl.arange(0, BLOCK_HD)
    head, dim = offs // HEAD_DIM, offs % HEAD_DIM
    # A masked-off program (slot -1) issues no memory traffic at all. (The slot test is
    # broadcast to a vector first: the CPU interpreter rejects a scalar-and-vector mask.)
    mask = (offs < ROW) & ((offs * 0 + slot) >= 0)
    k = tl.load(key_ptr + token * stride_kn + head * stride_kh + dim, mask=mask)
    v = tl.load(value_ptr + token * stride_vn + head * stride_vh + dim, mask=mask)
    block, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
    dst = block * stride_cb + offset * stride_cs + head * stride_ch + dim
    tl.store(k_cache_ptr + dst, quantize_kv(k, k_scale, k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, quantize_kv(v, v_scale, v_cache_ptr.dtype.element_ty), mask=mask)


def store_kvcache_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Triton version of store_kvcache (see kernels/__init__.py for the contract)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError(f"store_kvcache: last-axis strides key {key.stride(-1)}, value "
                         f"{value.stride(-1)}: allowed: 1 each (a contiguous head_dim axis)")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError(f"store_kvcache: k_cache strides {k_cache.stride()}, v_cache strides "
                         f"{v_cache.stride()}: allowed: equal strides, the last (head_dim) 1")
    if num_tokens == 0:
        return
    row = num_kv_heads * head_dim
    _store_kvcache_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        k_scale,
        v_scale,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        BLOCK_SIZE=k_cache.shape[1],
        HEAD_DIM=head_dim,
        BLOCK_HD=triton.next_power_of_2(row),
        ROW=row,
        **pdl_args(key),
        num_warps=4,
    )
