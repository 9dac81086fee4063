"""Triton kernels for the small per-token ops of a decoder layer (references and contracts in
kernels/reference.py).

Why they exist: in PyTorch, RMSNorm with its residual add is ~8 kernels, per-head q/k
RMSNorm plus RoPE ~25, SiLU-and-mul 3; each reads and writes the whole tensor, and each costs
a few microseconds even inside a CUDA graph. Measured on an H200 (docs/benchmarks.md), a
Qwen3-0.6B decode step issued ~2,200 kernels, most of them these, and batch-1 decode took
5.6 ms per token where the weights alone take ~0.3 ms to read. Here each op is ONE kernel
that loads its input once, does every step in registers, and stores once.

Each kernel repeats the reference's rounding steps (e.g. the RMSNorm output is rounded to
the model dtype BEFORE the weight multiply, as HF does), so the results agree with the
references to float32 round-off in the reductions, not just "closely".

    rms_norm:     one program per row             [x (+ residual)] -> norm, new residual
    norm_rope:    one program per token, all heads of q and k   x1 | x2 -> normed -> rotated
                  (+ this token's rotated k and its v written into the paged KV cache:
                  norm_rope_store_kvcache_triton, the store kernel's work in the same launch)
    silu_and_mul: one program per (row, column tile)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .fp8_kv import quantize_kv
from .pdl import pdl_args, pdl_wait


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,  # read when HAS_RESIDUAL
    weight_ptr,
    out_ptr,
    residual_out_ptr,  # written when HAS_RESIDUAL: the rounded sum x + residual
    stride_x,
    stride_r,
    hidden_size,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,  # kernels/pdl.py (all three kernels here)
):
    pdl_wait(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden_size
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        x = (x + r).to(dtype)  # the residual stream is the rounded sum
        tl.store(residual_out_ptr + row * hidden_size + offs, x, mask=mask)
        x = x.to(tl.float32)
    variance = tl.sum(x * x, axis=0) / hidden_size
    y = (x * tl.math.rsqrt(variance + eps)).to(dtype)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0)
    y = (y.to(tl.float32) * w.to(tl.float32)).to(dtype)
    tl.store(out_ptr + row * hidden_size + offs, y, mask=mask)


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    hidden_size = x.shape[-1]
    x2d = x.reshape(-1, hidden_size)
    if x2d.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError("rms_norm: x and weight need a contiguous last axis")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x2d.shape[0] == 0:
        return out if residual is None else (out, torch.empty_like(out))
    block = triton.next_power_of_2(hidden_size)
    num_warps = min(16, max(1, block // 256))
    pdl = pdl_args(x)
    if residual is None:
        _rms_norm_kernel[(x2d.shape[0],)](
            x2d, x2d, weight, out, out, x2d.stride(0), 0, hidden_size, eps,
            HAS_RESIDUAL=False, BLOCK=block, num_warps=num_warps, **pdl,
        )  # fmt: skip
        return out
    r2d = residual.reshape(-1, hidden_size)
    if r2d.shape != x2d.shape or r2d.stride(-1) != 1:
        raise ValueError(f"rms_norm: residual {tuple(residual.shape)} must match x "
                         f"{tuple(x.shape)} with a contiguous last axis")
    new_residual = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _rms_norm_kernel[(x2d.shape[0],)](
        x2d, r2d, weight, out, new_residual, x2d.stride(0), r2d.stride(0), hidden_size, eps,
        HAS_RESIDUAL=True, BLOCK=block, num_warps=num_warps, **pdl,
    )  # fmt: skip
    return out, new_residual


@triton.jit
def _norm_rope_heads(
    src,  # this token's first head of q (or k)
    stride_h,
    num_heads,
    weight_ptr,
    dst,  # this token's first head of q_out (or k_out), contiguous heads
    cos,  # [1, HALF_PAD] float32, this token's angles
    sin,
    eps,
    HEAD_DIM: tl.constexpr,
    HALF_PAD: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HAS_NORM: tl.constexpr,
):
    """All heads of one token as a [heads, D/2] tile: x1 = first half, x2 = second half."""
    half: tl.constexpr = HEAD_DIM // 2
    heads = tl.arange(0, HEADS_PAD)[:, None]
    offs = tl.arange(0, HALF_PAD)[None, :]
    mask = (heads < num_heads) & (offs < half)
    dtype = dst.dtype.element_ty
    x1 = tl.load(src + heads * stride_h + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + heads * stride_h + half + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        variance = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / HEAD_DIM
        rstd = tl.math.rsqrt(variance + eps)[:, None]
        w1 = tl.load(weight_ptr + offs, mask=offs < half, other=0.0).to(tl.float32)
        w2 = tl.load(weight_ptr + half + offs, mask=offs < half, other=0.0).to(tl.float32)
        # Round where the reference rounds: after the norm, and after the weight multiply.
        x1 = ((x1 * rstd).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
        x2 = ((x2 * rstd).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
    out1, out2 = (x1 * cos - x2 * sin).to(dtype), (x2 * cos + x1 * sin).to(dtype)
    out = dst + heads * HEAD_DIM + offs
    tl.store(out, out1, mask=mask)
    tl.store(out + half, out2, mask=mask)
    return out1, out2


@triton.jit
def _store_heads(
    cache_row,  # this token's slot in the cache: its first head
    stride_ch,
    x1,  # [HEADS_PAD, HALF_PAD]: the first and second halves of each head, model dtype
    x2,
    mask,
    scale,  # fp8 cache: stored = x / scale
    HEAD_DIM: tl.constexpr,
    HALF_PAD: tl.constexpr,
    HEADS_PAD: tl.constexpr,
):
    """Write one token's heads into its cache slot, as store_kvcache does (fp8: quantized)."""
    half: tl.constexpr = HEAD_DIM // 2
    cache_dtype = cache_row.dtype.element_ty
    dst = cache_row + tl.arange(0, HEADS_PAD)[:, None] * stride_ch + tl.arange(0, HALF_PAD)[None, :]
    tl.store(dst, quantize_kv(x1, scale, cache_dtype), mask=mask)
    tl.store(dst + half, quantize_kv(x2, scale, cache_dtype), mask=mask)


@triton.jit
def _norm_rope_kernel(
    q_ptr,  # [N, Hq, D], any token/head strides, contiguous D
    k_ptr,  # [N, Hk, D], likewise
    positions_ptr,  # [N]
    cos_sin_ptr,  # [max_position, D] float32: cos | sin
    q_weight_ptr,  # [D], read when HAS_NORM
    k_weight_ptr,
    q_out_ptr,  # [N, Hq, D] contiguous
    k_out_ptr,  # [N, Hk, D] contiguous
    v_ptr,  # [N, Hk, D], any token/head strides: read when STORE_KV
    k_cache_ptr,  # [num_blocks, block_size, Hk, D], written when STORE_KV (and v_cache)
    v_cache_ptr,
    slot_mapping_ptr,  # [N]: cache slot per token, -1 = padding (nothing written)
    k_scale,  # fp8 cache: stored = k / k_scale (unused for other caches)
    v_scale,
    stride_qn,
    stride_qh,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    stride_cb,  # cache strides: block, slot-in-block, head (k and v caches share them)
    stride_cs,
    stride_ch,
    num_q_heads,
    num_k_heads,
    eps,
    HEAD_DIM: tl.constexpr,
    HALF_PAD: tl.constexpr,  # next power of two >= HEAD_DIM // 2
    Q_HEADS_PAD: tl.constexpr,  # next power of two >= num_q_heads (and the same for k)
    K_HEADS_PAD: tl.constexpr,
    HAS_NORM: tl.constexpr,
    STORE_KV: tl.constexpr,
    PAGE: tl.constexpr,  # tokens per cache block, when STORE_KV
    USE_PDL: tl.constexpr,
):
    pdl_wait(USE_PDL)
    # One program per token takes all its q and k heads as two tiles, and loads the token's
    # angles once. At batch 256 on the H200 that is 3.0 us per call; one one-warp program per
    # head (6,144 programs) took 5.1 us (docs/benchmarks.md).
    token = tl.program_id(0).to(tl.int64)
    half: tl.constexpr = HEAD_DIM // 2
    offs = tl.arange(0, HALF_PAD)[None, :]
    position = tl.load(positions_ptr + token).to(tl.int64)
    cos = tl.load(cos_sin_ptr + position * HEAD_DIM + offs, mask=offs < half, other=0.0)
    sin = tl.load(cos_sin_ptr + position * HEAD_DIM + half + offs, mask=offs < half, other=0.0)
    _norm_rope_heads(q_ptr + token * stride_qn, stride_qh, num_q_heads, q_weight_ptr,
                     q_out_ptr + token * num_q_heads * HEAD_DIM, cos, sin, eps,
                     HEAD_DIM, HALF_PAD, Q_HEADS_PAD, HAS_NORM)  # fmt: skip
    k1, k2 = _norm_rope_heads(k_ptr + token * stride_kn, stride_kh, num_k_heads, k_weight_ptr,
                              k_out_ptr + token * num_k_heads * HEAD_DIM, cos, sin, eps,
                              HEAD_DIM, HALF_PAD, K_HEADS_PAD, HAS_NORM)  # fmt: skip
    if STORE_KV:
        # The store kernel's work, while the rotated k is still in registers: one launch
        # less per layer. The cache gets the rounded k that k_out holds.
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
        heads = tl.arange(0, K_HEADS_PAD)[:, None]
        # slot -1: no memory traffic. (Broadcast first: the CPU interpreter rejects a
        # scalar-and-tile mask.)
        mask = (heads < num_k_heads) & (offs < half) & ((heads * 0 + slot) >= 0)
        v_row = v_ptr + token * stride_vn + heads * stride_vh + offs
        v1 = tl.load(v_row, mask=mask, other=0.0)
        v2 = tl.load(v_row + half, mask=mask, other=0.0)
        cache_row = (slot // PAGE) * stride_cb + (slot % PAGE) * stride_cs
        _store_heads(k_cache_ptr + cache_row, stride_ch, k1, k2, mask, k_scale,
                     HEAD_DIM, HALF_PAD, K_HEADS_PAD)  # fmt: skip
        _store_heads(v_cache_ptr + cache_row, stride_ch, v1, v2, mask, v_scale,
                     HEAD_DIM, HALF_PAD, K_HEADS_PAD)  # fmt: skip


def norm_rope_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _norm_rope(q, k, positions, cos_sin_cache, q_norm_weight, k_norm_weight, eps, None)


@dataclass(frozen=True)
class KVStore:
    """Where norm_rope_store_kvcache_triton writes k (rotated) and v: store_kvcache's
    arguments."""

    v: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor
    k_scale: float
    v_scale: float


def norm_rope_store_kvcache_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """norm_rope_triton, then store_kvcache of its k and of v, in one launch."""
    num_tokens, num_k_heads, head_dim = k.shape
    if v.shape != k.shape or v.dtype != k.dtype or v.stride(-1) != 1:
        raise ValueError(f"norm_rope_store_kvcache: v {tuple(v.shape)} {v.dtype} must match k "
                         f"{tuple(k.shape)} {k.dtype}, with a contiguous head_dim axis")
    if (k_cache.dim() != 4 or tuple(k_cache.shape[2:]) != (num_k_heads, head_dim)
            or k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride()
            or k_cache.stride(-1) != 1):
        raise ValueError(f"norm_rope_store_kvcache: k_cache {tuple(k_cache.shape)} and v_cache "
                         f"{tuple(v_cache.shape)} must be [num_blocks, block_size, {num_k_heads}, "
                         f"{head_dim}] with equal strides and a contiguous head_dim axis")
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"norm_rope_store_kvcache: slot_mapping {tuple(slot_mapping.shape)} "
                         f"must hold one slot per token ({num_tokens})")
    store = KVStore(v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return _norm_rope(q, k, positions, cos_sin_cache, q_norm_weight, k_norm_weight, eps, store)


def _norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
    eps: float,
    store: KVStore | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    num_tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    if k.shape[0] != num_tokens or k.shape[2] != head_dim or k.dtype != q.dtype:
        raise ValueError(f"norm_rope: q {tuple(q.shape)} {q.dtype} and k {tuple(k.shape)} "
                         f"{k.dtype} need the same tokens, head_dim and dtype")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or not cos_sin_cache.is_contiguous():
        raise ValueError("norm_rope: q and k need a contiguous head_dim axis, cos_sin_cache must "
                         "be contiguous")
    if cos_sin_cache.dtype != torch.float32 or cos_sin_cache.shape[-1] != head_dim:
        raise ValueError(f"norm_rope: cos_sin_cache must be float32 [max_position, {head_dim}], "
                         f"got {cos_sin_cache.dtype} {tuple(cos_sin_cache.shape)}")
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("norm_rope: give both q and k norm weights, or neither")
    q_out = torch.empty((num_tokens, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    k_out = torch.empty((num_tokens, num_k_heads, head_dim), dtype=k.dtype, device=k.device)
    if num_tokens == 0:
        return q_out, k_out
    has_norm = q_norm_weight is not None
    if store is None:  # the store's pointers and strides are not read (STORE_KV=False)
        v, k_cache, v_cache, slots, k_scale, v_scale = k, k_out, k_out, positions, 1.0, 1.0
        cache_strides, page = (0, 0, 0), 1
    else:
        v, k_cache, v_cache = store.v, store.k_cache, store.v_cache
        slots, k_scale, v_scale = store.slot_mapping, store.k_scale, store.v_scale
        cache_strides = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2))
        page = k_cache.shape[1]
    _norm_rope_kernel[(num_tokens,)](
        q, k, positions, cos_sin_cache,
        q_norm_weight if has_norm else q, k_norm_weight if has_norm else k,
        q_out, k_out, v, k_cache, v_cache, slots, k_scale, v_scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        *cache_strides, num_q_heads, num_k_heads, eps,
        HEAD_DIM=head_dim,
        HALF_PAD=triton.next_power_of_2(head_dim // 2),
        Q_HEADS_PAD=triton.next_power_of_2(num_q_heads),
        K_HEADS_PAD=triton.next_power_of_2(num_k_heads),
        HAS_NORM=has_norm,
        STORE_KV=store is not None,
        PAGE=page,
        **pdl_args(q),
        num_warps=4,
    )  # fmt: skip
    return q_out, k_out


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,  # [N, 2I]: gate | up
    out_ptr,  # [N, I]
    stride_x,
    inter_size,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_wait(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter_size
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter_size + offs, mask=mask, other=0.0).to(tl.float32)
    # F.silu rounds to the model dtype before the multiply.
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * inter_size + offs, (act * up).to(dtype), mask=mask)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    inter_size = x.shape[-1] // 2
    x2d = x.reshape(-1, x.shape[-1])
    if x2d.stride(-1) != 1:
        raise ValueError("silu_and_mul: x needs a contiguous last axis")
    out = torch.empty((*x.shape[:-1], inter_size), dtype=x.dtype, device=x.device)
    if x2d.shape[0] == 0:
        return out
    block = min(1024, triton.next_power_of_2(inter_size))
    _silu_and_mul_kernel[(x2d.shape[0], triton.cdiv(inter_size, block))](
        x2d, out, x2d.stride(0), inter_size, BLOCK=block, **pdl_args(x),
        num_warps=4,
    )  # fmt: skip
    return out
