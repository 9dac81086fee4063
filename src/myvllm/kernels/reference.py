"""Plain-PyTorch versions of the kernels a decoder layer runs, with their signatures: what a
CPU runs, and the oracle of the Triton kernels.

The three attention kernels (float32 math, one sequence at a time):

    store_kvcache_ref, flash_attention_varlen_ref, paged_attention_decode_ref

    k_cache[num_blocks, block_size, num_kv_heads, head_dim]
    slot = block_id * block_size + offset; position p of sequence b is in block
    block_tables[b, p // block_size] at offset p % block_size

An fp8 cache holds K / k_scale and V / v_scale; reads multiply the scale back
(fp8_kv_reference.py, which runs only for an fp8 cache).

The three small per-token ops (oracle of kernels/layer_ops_triton.py), numerics as HF
transformers: the residual sum rounded to the model dtype, the norm and the rotation in
float32, F.silu rounded before the multiply:

    rms_norm_ref, norm_rope_ref, silu_and_mul_ref
"""

from __future__ import annotations

from typing import overload

import torch
import torch.nn.functional as F

from .fp8_kv_reference import FP8_DTYPE, dequantize_kv, quantize_kv


def to_cache(x: torch.Tensor, cache: torch.Tensor, scale: float) -> torch.Tensor:
    """x as ``cache`` stores it: quantized for an fp8 cache, else cast to its dtype."""
    if cache.dtype == FP8_DTYPE:
        return quantize_kv(x, cache.dtype, scale)
    return x.to(cache.dtype)


def from_cache(stored: torch.Tensor, scale: float) -> torch.Tensor:
    """Cache elements back to values, in float32 (an fp8 cache's times their scale)."""
    if stored.dtype == FP8_DTYPE:
        return dequantize_kv(stored, scale)
    return stored.float()


def store_kvcache_ref(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0,
) -> None:
    """Write key[i]/value[i] ([N, Hkv, D]) into cache slot slot_mapping[i]; -1 means skip."""
    block_size = k_cache.shape[1]
    keep = slot_mapping >= 0  # -1 marks padding tokens (CUDA-graph batches are padded)
    slots = slot_mapping[keep].long()
    blocks, offsets = slots // block_size, slots % block_size
    # Advanced-index assignment writes in place whatever the cache's strides are.
    k_cache[blocks, offsets] = to_cache(key[keep], k_cache, k_scale)
    v_cache[blocks, offsets] = to_cache(value[keep], v_cache, v_scale)


def gather_paged_kv(
    cache: torch.Tensor, block_table_row: torch.Tensor, num_tokens: int
) -> torch.Tensor:
    """Return the first num_tokens positions of one sequence as a contiguous [T, Hkv, D]."""
    block_size = cache.shape[1]
    positions = torch.arange(num_tokens, device=cache.device)
    blocks = block_table_row[positions // block_size].long()
    return cache[blocks, positions % block_size]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of Sq queries that are the LAST Sq of Sk context positions (query i
    at position Sk - Sq + i): q [Sq, Hq, D], k/v [Sk, Hkv, D] -> [Sq, Hq, D] in float32."""
    seqlen_q, num_heads = q.shape[0], q.shape[1]
    seqlen_k, num_kv_heads = k.shape[0], k.shape[1]
    group = num_heads // num_kv_heads
    # GQA: query head h reads kv head h // group, so repeat each kv head `group` times.
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    q_pos = torch.arange(seqlen_q, device=q.device)[:, None] + (seqlen_k - seqlen_q)
    k_pos = torch.arange(seqlen_k, device=q.device)[None, :]
    scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def flash_attention_varlen_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
    scale: float, block_tables: torch.Tensor | None = None, k_cache: torch.Tensor | None = None,
    v_cache: torch.Tensor | None = None, k_scale: float = 1.0, v_scale: float = 1.0,
) -> torch.Tensor:
    """Causal prefill attention over a flat batch: sequence b owns the rows cu_seqlens_q[b] :
    cu_seqlens_q[b+1] of q [Nq, Hq, D], and the same of k/v [Nk, Hkv, D] by cu_seqlens_k.

    With block_tables, the context of sequence b (cached prefix + the new tokens, which the
    caller already stored with store_kvcache) is read from k_cache/v_cache instead (an fp8
    cache dequantized with k_scale/v_scale). max_seqlen_* size the Triton kernel's grid only.
    """
    del max_seqlen_q, max_seqlen_k
    out = torch.empty_like(q)
    # On the CPU tolist() is a plain read; this reference is not used on the GPU hot path.
    starts_q = cu_seqlens_q.tolist()
    starts_k = cu_seqlens_k.tolist()
    for b in range(len(starts_q) - 1):
        q_b = q[starts_q[b] : starts_q[b + 1]]
        seqlen_k = starts_k[b + 1] - starts_k[b]
        if q_b.shape[0] == 0:
            continue
        if block_tables is None:
            k_b = k[starts_k[b] : starts_k[b + 1]]
            v_b = v[starts_k[b] : starts_k[b + 1]]
        else:
            if k_cache is None or v_cache is None:
                raise ValueError("block_tables given but k_cache/v_cache is None")
            k_b = from_cache(gather_paged_kv(k_cache, block_tables[b], seqlen_k), k_scale)
            v_b = from_cache(gather_paged_kv(v_cache, block_tables[b], seqlen_k), v_scale)
        out[starts_q[b] : starts_q[b + 1]] = _attend(q_b, k_b, v_b, scale).to(q.dtype)
    return out


def paged_attention_decode_ref(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, scale: float, k_scale: float = 1.0, v_scale: float = 1.0,
) -> torch.Tensor:
    """One new query token per sequence attends to its context_lens[b] cached tokens.

    q [B, Hq, D], block_tables [B, max_blocks] (-1 padded), context_lens [B] -> o [B, Hq, D].
    Vectorised over the batch: every sequence gathers its padded table's positions, and those
    past its context length are masked out. An fp8 cache is dequantized with k_scale/v_scale.
    """
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    max_len = block_tables.shape[1] * block_size
    positions = torch.arange(max_len, device=q.device)
    # -1 table entries are only ever read for masked positions; clamp so the gather is legal.
    blocks = block_tables.long().clamp(min=0)[:, positions // block_size]  # [B, L]
    offsets = (positions % block_size).expand(batch, -1)
    k = from_cache(k_cache[blocks, offsets], k_scale)  # [B, L, Hkv, D] float32
    v = from_cache(v_cache[blocks, offsets], v_scale)
    valid = positions[None, :] < context_lens.long()[:, None]  # [B, L]
    # Slots past the context may hold anything (the cache is allocated uninitialised, even
    # NaN bit patterns): zero K and V there, since a NaN score survives the mask and
    # 0 * NaN would poison the weighted sum.
    k = k.masked_fill(~valid[:, :, None, None], 0.0)
    v = v.masked_fill(~valid[:, :, None, None], 0.0)
    # softmax(q k^T * scale) v with the padded positions masked out; enable_gqa lets each
    # group of `group` query heads share one kv head, exactly as in the Triton kernel.
    out = torch.nn.functional.scaled_dot_product_attention(
        q.float().unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2),  # [B, H, 1 or L, D]
        attn_mask=valid[:, None, None, :], scale=scale, enable_gqa=group > 1)
    # Context length 0 (CUDA-graph padding) masks every position: zeros for those rows only,
    # so a NaN read from inside a real context still shows.
    out = out.masked_fill((context_lens == 0)[:, None, None, None], 0.0)
    return out.reshape(batch, num_heads, head_dim).to(q.dtype)


# rms_norm_ref returns one tensor, or (out, residual stream) when given a residual; the
# overloads tell the type checker which.
@overload
def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: None = None) -> torch.Tensor: ...
@overload
def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...
def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last axis. With residual: returns (rmsnorm(x + residual), x + residual)."""
    if residual is not None:
        # The add happens in float32 and is rounded once, like HF's `residual + hidden`.
        new_residual = (x.float() + residual.float()).to(x.dtype)
        return rms_norm_ref(new_residual, weight, eps), new_residual
    dtype = x.dtype
    x32 = x.float()
    variance = x32.pow(2).mean(dim=-1, keepdim=True)
    return (x32 * torch.rsqrt(variance + eps)).to(dtype) * weight


def norm_rope_ref(
    x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
    norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
) -> torch.Tensor:
    """x [N, H, D] (one row per token) -> RoPE(rmsnorm_per_head(x)) [N, H, D], contiguous.

    norm_weight [D] is Qwen3's q_norm/k_norm (None: rotate only, as Llama does).
    cos_sin_cache [max_position, D] float32 holds cos in its first half, sin in its second;
    row positions[i] rotates token i (neox layout: pairs (x[j], x[j + D/2])).
    """
    if norm_weight is not None:
        x = rms_norm_ref(x, norm_weight, eps)
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)  # each [N, D/2]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # broadcast over heads
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x [N, 2I] = [gate | up] -> silu(gate) * up [N, I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
