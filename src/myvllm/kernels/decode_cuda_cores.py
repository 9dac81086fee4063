"""Triton: the decode kernel's program for small GQA groups, scores on the CUDA cores.

decode_attention.py's tensor-core program pads the GROUP query heads of a kv head to the 16
rows a tl.dot needs: with Qwen3-0.6B's 2 query heads a kv head, 7/8 of its dot products
and of its softmax are padding. Over an fp8 cache, whose bytes take half as long to read as
a bf16 cache's, that padded work per key is what bounds the kernel. This program does only
the real heads' work, on the CUDA cores:

    scores   s[n] = sum_d q[d] * k[n, d]          one query head at a time, q [D], k [N, D]
    values   acc[n, :] += p[n] * v[n, :]           no reduction over the keys in the loop

Each of the tile's BLOCK_N rows keeps its own online softmax (max m[n], sum l[n], acc[n, D])
over the keys it meets (n, n + BLOCK_N, n + 2 BLOCK_N, ...), so the loop never reduces across
rows, which would cost shared memory and a barrier per tile; the rows are merged once, after
the loop, as split-K merges its splits. Per key and head the softmax takes one exp2: of the
running max m and the new score s, the smaller one relative to the larger (1 for the larger).

The scales are applied once per program, not per element: softmax scale * log2(e) and an fp8
cache's k_scale multiply the float32 queries before the loop, v_scale the output after it.
Each loaded tile is converted to float32 once and used by every head of the group. The loop
is a tl.range with num_stages (LOAD_STAGES): Triton pipelines a loop's loads only when they
feed a tl.dot or the loop names its stages, and with it the next tiles' K and V are copied to
shared memory (cp.async) while this tile's arithmetic runs. (Prefetching them into registers
by hand instead cost ~80 byte-shuffling instructions a tile: a loop-carried fp8 tile is held
one byte a register.)

Up to MAX_GROUP query heads a kv head (their state is held in separate variables); larger
groups take the tensor-core program, whose padding then costs little.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .fp8_kv import cache_scale
from .pdl import pdl_wait

MAX_GROUP = 4


@triton.jit
def tile_rows(bt_row_ptr, kv_base, start, hi, offs_n, stride_cb, stride_cs, PAGE: tl.constexpr):
    """Cache offsets of keys start .. start + BLOCK_N of one sequence and kv head (found
    through its block table row), and which of them are below hi."""
    pos = start + offs_n
    n_mask = pos < hi
    blk = tl.load(bt_row_ptr + pos // PAGE, mask=n_mask, other=0).to(tl.int64)
    return kv_base + blk * stride_cb + (pos % PAGE) * stride_cs, n_mask


@triton.jit
def _load_tile(k_cache_ptr, v_cache_ptr, bt_row_ptr, kv_base, start, hi, offs_n, offs_d, d_mask,
               stride_cb, stride_cs, PAGE: tl.constexpr):
    """K and V of keys start .. start + len(offs_n), float32 (zeros past hi), and their mask."""
    rows, mask = tile_rows(bt_row_ptr, kv_base, start, hi, offs_n, stride_cb, stride_cs, PAGE)
    kv_mask = mask[:, None] & d_mask[None, :]
    k = tl.load(k_cache_ptr + rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_cache_ptr + rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    return k.to(tl.float32), v.to(tl.float32), mask


@triton.jit
def _head_update(q, k, v, n_mask, m, l, acc):
    """One query head's per-row online softmax over one tile: q [D] (scaled), k and v
    [BLOCK_N, D] float32, state m, l [BLOCK_N] and acc [BLOCK_N, D]."""
    s = tl.sum(q[None, :] * k, 1)
    s = tl.where(n_mask, s, float("-inf"))
    top = tl.maximum(m, s)
    # exp2(smaller - larger): alpha (the old state's weight) if s is the new max, else p.
    # A row that has seen no key yet (both -inf) gets 0 here, not inf - inf.
    e = tl.math.exp2(tl.minimum(m, s) - tl.where(top == float("-inf"), 0.0, top))
    grew = s > m
    alpha = tl.where(grew, e, 1.0)
    p = tl.where(grew, 1.0, e)
    return top, l * alpha + p, acc * alpha[:, None] + p[:, None] * v


@triton.jit
def _head_update_pair(q, k_a, v_a, mask_a, k_b, v_b, mask_b, m, l, acc):
    """_head_update over two tiles at once, each row meeting two keys (KEYS_PER_ROW = 2): the
    state is rescaled once for both, and its rows are half the keys of an iteration."""
    s_a = tl.where(mask_a, tl.sum(q[None, :] * k_a, 1), float("-inf"))
    s_b = tl.where(mask_b, tl.sum(q[None, :] * k_b, 1), float("-inf"))
    top = tl.maximum(m, tl.maximum(s_a, s_b))
    ref = tl.where(top == float("-inf"), 0.0, top)  # no key yet: 0, not inf - inf
    alpha = tl.math.exp2(m - ref)
    p_a = tl.math.exp2(s_a - ref)
    p_b = tl.math.exp2(s_b - ref)
    acc = acc * alpha[:, None] + p_a[:, None] * v_a + p_b[:, None] * v_b
    return top, l * alpha + p_a + p_b, acc


@triton.jit
def _store_head(m_rows, l_rows, acc_rows, v_factor, seq, head, split, o_ptr, m_part_ptr,
                l_part_ptr, acc_part_ptr, stride_ob, stride_oh, num_heads, offs_d, d_mask,
                HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr):
    """Merge one head's BLOCK_N row states and write its output (one split) or partial."""
    m = tl.max(m_rows, 0)
    w = tl.math.exp2(m_rows - tl.where(m == float("-inf"), 0.0, m))  # 0 for rows with no key
    l = tl.sum(w * l_rows, 0)
    acc = tl.sum(w[:, None] * acc_rows, 0) * v_factor
    if NUM_SPLITS == 1:
        # l is 0 only for an empty context (a padding row): write zeros, not NaN.
        out = acc / tl.where(l > 0.0, l, 1.0)
        o_ptrs = o_ptr + seq.to(tl.int64) * stride_ob + head * stride_oh + offs_d
        tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=d_mask)
    else:
        part = (seq.to(tl.int64) * num_heads + head) * NUM_SPLITS + split
        tl.store(m_part_ptr + part, m)
        tl.store(l_part_ptr + part, l)
        tl.store(acc_part_ptr + part * HEAD_DIM + offs_d, acc, mask=d_mask)


@triton.jit
def _load_query(q_row_ptr, head, stride_qh, offs_d, d_mask, fold):
    """One query head's row, float32, times the folded scales."""
    return tl.load(q_row_ptr + head * stride_qh, mask=d_mask, other=0.0).to(tl.float32) * fold


@triton.jit
def paged_decode_cuda_cores_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
    o_ptr, m_part_ptr, l_part_ptr, acc_part_ptr,  # as decode_attention's split kernel
    qk_scale, k_scale, v_scale,
    stride_qb, stride_qh, stride_cb, stride_cs, stride_ch, stride_bt, stride_ob, stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    LOAD_STAGES: tl.constexpr,
    KEYS_PER_ROW: tl.constexpr,  # 1 or 2: keys each state row meets per iteration
    USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl_wait(USE_PDL)
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_heads = tl.num_programs(1) * GROUP

    context_len = tl.load(context_lens_ptr + seq)
    # The same cut into splits as the tensor-core program's (decode_attention.py).
    num_tiles = tl.cdiv(context_len, BLOCK_N)
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    lo = split * tiles_per_split * BLOCK_N
    hi = tl.minimum(lo + tiles_per_split * BLOCK_N, context_len)

    ROWS: tl.constexpr = BLOCK_N // KEYS_PER_ROW  # state rows; BLOCK_N keys an iteration
    offs_n = tl.arange(0, ROWS)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    head0 = kv_head * GROUP
    q_row_ptr = q_ptr + seq.to(tl.int64) * stride_qb + offs_d
    fold = qk_scale * cache_scale(k_scale, k_cache_ptr.dtype.element_ty)
    v_factor = cache_scale(v_scale, v_cache_ptr.dtype.element_ty)
    # Up to MAX_GROUP heads' queries and states; those past GROUP are never updated (the
    # compiler drops them).
    q0 = _load_query(q_row_ptr, head0, stride_qh, offs_d, d_mask, fold)
    q1 = q0
    q2 = q0
    q3 = q0
    if GROUP > 1:
        q1 = _load_query(q_row_ptr, head0 + 1, stride_qh, offs_d, d_mask, fold)
    if GROUP > 2:
        q2 = _load_query(q_row_ptr, head0 + 2, stride_qh, offs_d, d_mask, fold)
    if GROUP > 3:
        q3 = _load_query(q_row_ptr, head0 + 3, stride_qh, offs_d, d_mask, fold)
    m0 = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    l0 = tl.zeros([ROWS], dtype=tl.float32)
    acc0 = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
    m1, l1, acc1 = m0, l0, acc0
    m2, l2, acc2 = m0, l0, acc0
    m3, l3, acc3 = m0, l0, acc0

    bt_row_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    kv_base = kv_head * stride_ch
    for start in tl.range(lo, hi, BLOCK_N, num_stages=LOAD_STAGES):
        k, v, mask = _load_tile(k_cache_ptr, v_cache_ptr, bt_row_ptr, kv_base, start, hi,
                                offs_n, offs_d, d_mask, stride_cb, stride_cs, PAGE)
        if KEYS_PER_ROW == 1:
            m0, l0, acc0 = _head_update(q0, k, v, mask, m0, l0, acc0)
            if GROUP > 1:
                m1, l1, acc1 = _head_update(q1, k, v, mask, m1, l1, acc1)
            if GROUP > 2:
                m2, l2, acc2 = _head_update(q2, k, v, mask, m2, l2, acc2)
            if GROUP > 3:
                m3, l3, acc3 = _head_update(q3, k, v, mask, m3, l3, acc3)
        else:
            k_b, v_b, mask_b = _load_tile(k_cache_ptr, v_cache_ptr, bt_row_ptr, kv_base,
                                          start + ROWS, hi, offs_n, offs_d, d_mask, stride_cb,
                                          stride_cs, PAGE)
            m0, l0, acc0 = _head_update_pair(q0, k, v, mask, k_b, v_b, mask_b, m0, l0, acc0)
            if GROUP > 1:
                m1, l1, acc1 = _head_update_pair(q1, k, v, mask, k_b, v_b, mask_b, m1, l1, acc1)
            if GROUP > 2:
                m2, l2, acc2 = _head_update_pair(q2, k, v, mask, k_b, v_b, mask_b, m2, l2, acc2)
            if GROUP > 3:
                m3, l3, acc3 = _head_update_pair(q3, k, v, mask, k_b, v_b, mask_b, m3, l3, acc3)

    _store_head(m0, l0, acc0, v_factor, seq, head0, split, o_ptr, m_part_ptr, l_part_ptr,
                acc_part_ptr, stride_ob, stride_oh, num_heads, offs_d, d_mask, HEAD_DIM,
                NUM_SPLITS)
    if GROUP > 1:
        _store_head(m1, l1, acc1, v_factor, seq, head0 + 1, split, o_ptr, m_part_ptr,
                    l_part_ptr, acc_part_ptr, stride_ob, stride_oh, num_heads, offs_d, d_mask,
                    HEAD_DIM, NUM_SPLITS)
    if GROUP > 2:
        _store_head(m2, l2, acc2, v_factor, seq, head0 + 2, split, o_ptr, m_part_ptr,
                    l_part_ptr, acc_part_ptr, stride_ob, stride_oh, num_heads, offs_d, d_mask,
                    HEAD_DIM, NUM_SPLITS)
    if GROUP > 3:
        _store_head(m3, l3, acc3, v_factor, seq, head0 + 3, split, o_ptr, m_part_ptr,
                    l_part_ptr, acc_part_ptr, stride_ob, stride_oh, num_heads, offs_d, d_mask,
                    HEAD_DIM, NUM_SPLITS)


def supports_group(group: int) -> bool:
    """Whether this program can take a GQA group of `group` query heads a kv head."""
    return 1 <= group <= MAX_GROUP
