"""Teaching baselines for the benchmark scripts: the "first attempt" Triton kernels.

Not used by the engine. They exist so benchmark_prefilling.py / benchmark_decoding.py can show
what the real kernels buy:

- naive_attention_prefill_triton: one program per (sequence, head) holds the WHOLE sequence
  as a single tile: Q, K, V [S_PAD, D] and the scores [S_PAD, S_PAD] all live on chip at
  once. Simple, but its on-chip footprint grows with S^2, so it only compiles/runs for short
  sequences (NAIVE_PREFILL_MAX_SEQLEN), and it launches only batch * heads programs.
- paged_attention_decode_per_head_triton: one program per (sequence, query head), no split.
  Each program loads its kv head's K/V itself, so a kv head shared by G query heads is read
  G times, and with few sequences most SMs idle.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

LOG2E = math.log2(math.e)

# Largest padded sequence the one-tile kernel accepts. On GPU the [S, S] float32 score tile
# plus Q/K/V tiles must fit in registers/shared memory: 128 x 128 is already 64 KB of scores.
NAIVE_PREFILL_MAX_SEQLEN = 128


@triton.jit
def _naive_prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    cu_seqlens_ptr,
    scale,
    stride_qn,
    stride_qh,
    stride_kn,
    stride_kh,
    stride_on,
    stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    start = tl.load(cu_seqlens_ptr + seq)
    seqlen = tl.load(cu_seqlens_ptr + seq + 1) - start
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_s[:, None] < seqlen) & (offs_d[None, :] < HEAD_DIM)
    rows = (start + offs_s).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qn + head * stride_qh + offs_d[None, :], mask=mask,
                other=0.0)  # fmt: skip
    kv_off = rows[:, None] * stride_kn + (head // GROUP) * stride_kh + offs_d[None, :]
    k = tl.load(k_ptr + kv_off, mask=mask, other=0.0)
    v = tl.load(v_ptr + kv_off, mask=mask, other=0.0)
    scores = tl.dot(q, tl.trans(k)).to(tl.float32) * scale  # the whole [S, S] matrix at once
    causal = offs_s[None, :] <= offs_s[:, None]
    scores = tl.where(causal & (offs_s[None, :] < seqlen), scores, float("-inf"))
    probs = tl.exp(scores - tl.max(scores, 1)[:, None])
    probs = probs / tl.sum(probs, 1)[:, None]
    out = tl.dot(probs.to(v.dtype), v)
    tl.store(o_ptr + rows[:, None] * stride_on + head * stride_oh + offs_d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=mask)  # fmt: skip


def naive_attention_prefill_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    scale: float,
) -> torch.Tensor:
    """Causal attention, contiguous K/V, one tile per sequence. Raises ValueError when the
    longest sequence exceeds NAIVE_PREFILL_MAX_SEQLEN (the tile would not fit on chip)."""
    block_s = max(16, triton.next_power_of_2(max_seqlen))
    if block_s > NAIVE_PREFILL_MAX_SEQLEN:
        raise ValueError(
            f"naive one-tile prefill supports sequences up to {NAIVE_PREFILL_MAX_SEQLEN} "
            f"tokens, got {max_seqlen}"
        )
    num_tokens, num_heads, head_dim = q.shape
    o = torch.empty_like(q)
    batch = cu_seqlens.shape[0] - 1
    _naive_prefill_kernel[(batch, num_heads)](
        q, k, v, o, cu_seqlens, scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), o.stride(0), o.stride(1),
        GROUP=num_heads // k.shape[1],
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_S=block_s,
        num_warps=4 if block_s <= 64 else 8,
    )  # fmt: skip
    return o


@triton.jit
def _decode_per_head_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    o_ptr,
    qk_scale,
    stride_qb,
    stride_qh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    stride_ob,
    stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    context_len = tl.load(context_lens_ptr + seq)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q = tl.load(q_ptr + seq * stride_qb + head * stride_qh + offs_d, mask=d_mask, other=0.0)
    q = q.to(tl.float32)
    # Scalar running max / sum as 0-d float32 tensors (a Python float would change type
    # inside the loop, which Triton's compiler rejects for loop-carried values).
    m_i = tl.max(tl.full([BLOCK_N], float("-inf"), dtype=tl.float32), 0)
    l_i = tl.sum(tl.zeros([BLOCK_N], dtype=tl.float32), 0)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for start in range(0, context_len, BLOCK_N):
        pos = start + offs_n
        n_mask = pos < context_len
        blk = tl.load(block_tables_ptr + seq * stride_bt + pos // PAGE, mask=n_mask, other=0)
        rows = blk.to(tl.int64) * stride_cb + (pos % PAGE) * stride_cs + kv_head * stride_ch
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        # A single query row: a broadcast multiply + row sum instead of tl.dot.
        qk = tl.sum(q[None, :] * k.to(tl.float32), 1) * qk_scale
        qk = tl.where(n_mask, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 0))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(qk - m_new)
        l_i = l_i * alpha + tl.sum(p, 0)
        v = tl.load(v_cache_ptr + rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha + tl.sum(p[:, None] * v.to(tl.float32), 0)
        m_i = m_new
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)
    tl.store(o_ptr + seq * stride_ob + head * stride_oh + offs_d, out.to(o_ptr.dtype.element_ty),
             mask=d_mask)  # fmt: skip


def paged_attention_decode_per_head_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Same contract as paged_attention_decode; one program per (sequence, query head)."""
    batch, num_heads, head_dim = q.shape
    o = torch.empty_like(q)
    _decode_per_head_kernel[(batch, num_heads)](
        q, k_cache, v_cache, block_tables, context_lens, o, scale * LOG2E,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), o.stride(0), o.stride(1),
        GROUP=num_heads // k_cache.shape[2],
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_N=16 if q.device.type != "cuda" else 32,
        PAGE=k_cache.shape[1],
        num_warps=4,
    )  # fmt: skip
    return o
