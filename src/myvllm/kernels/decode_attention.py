"""Triton kernels: paged decode attention with GQA sharing and split-K (flash-decoding).

Decode reads the whole KV cache of every sequence for one query token: it is bound by memory
bandwidth, not by arithmetic. Two ideas keep the bytes moving:

1. GQA sharing. The GROUP query heads that share a kv head are handled by ONE program, which
   loads each K/V tile once and multiplies it with all GROUP queries at once (tl.dot needs at
   least 16 rows, so the query tile is padded with zero rows up to G_PAD >= 16):

       q tile [G_PAD, D]  @  K tile^T [D, BLOCK_N]  ->  scores [G_PAD, BLOCK_N]

2. Split-K. With few sequences (batch 1, long context) there are only batch * num_kv_heads
   programs, far fewer than the GPU's SMs. So each sequence's context is cut into NUM_SPLITS
   chunks, each program does one chunk and writes a partial (max m, sum l, unnormalised acc);
   a second small kernel merges the chunks:

       context:  [ split 0 | split 1 | split 2 | split 3 ]   -> (m_s, l_s, acc_s) each
       o = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s,      M = max_s m_s

   NUM_SPLITS is chosen from shapes only (batch, kv heads, max_blocks * block_size, SM count)
   and never from tensor values, so the launch is identical on every CUDA-graph replay.

Keys are found through the block table one token at a time (position p -> block
block_tables[b, p // block_size], offset p % block_size), so BLOCK_N and block_size need no
relation: a tile may span many small blocks or sit inside one big block. An fp8 cache's
tiles are cast as they are loaded, k_scale folded into the queries and v_scale into the
output (fp8_kv.py): half the bytes to read.

3. Scores without padding. Over an fp8 cache the padded dots and softmax of idea 1 cost more
   than reading the bytes (Qwen3-0.6B: 2 query heads a kv head, 7/8 of that work padding).
   For groups of up to 4 heads, the CUDA-core program (section 3 below) computes the scores
   on the CUDA cores for the real heads only; DECODE_SCORES chooses ("auto": by the cache's dtype,
   AUTO_CUDA_CORES_MAX_GROUP). Both programs write the same outputs and split partials.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch
import triton
import triton.language as tl

from .fp8_kv import cache_scale, dequantize_kv, fold_into_queries
from .pdl import pdl_args, pdl_wait

LOG2E = math.log2(math.e)


@triton.jit
def tile_rows(bt_row_ptr, kv_base, start, hi, offs_n, stride_cb, stride_cs, PAGE: tl.constexpr):
    """Cache offsets of keys start .. start + BLOCK_N of one sequence and kv head (found
    through its block table row), and which of them are below hi."""
    pos = start + offs_n
    n_mask = pos < hi
    blk = tl.load(bt_row_ptr + pos // PAGE, mask=n_mask, other=0).to(tl.int64)
    return kv_base + blk * stride_cb + (pos % PAGE) * stride_cs, n_mask


@triton.jit
def _paged_decode_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    o_ptr,  # [B, Hq, D]            written when NUM_SPLITS == 1
    m_part_ptr,  # [B, Hq, NUM_SPLITS]     partial results, written when NUM_SPLITS > 1
    l_part_ptr,
    acc_part_ptr,  # [B, Hq, NUM_SPLITS, D]
    qk_scale,  # softmax scale * log2(e)
    k_scale,  # fp8 cache: K = stored * k_scale (unused for other caches)
    v_scale,
    stride_qb,
    stride_qh,
    stride_cb,  # cache strides: block, slot-in-block, head (k and v caches share them)
    stride_cs,
    stride_ch,
    stride_bt,
    stride_ob,
    stride_oh,
    GROUP: tl.constexpr,
    G_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,  # kernels/pdl.py
):
    pdl_wait(USE_PDL)
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    context_len = tl.load(context_lens_ptr + seq)
    # Split this sequence's tiles evenly; every split starts on a tile boundary.
    num_tiles = tl.cdiv(context_len, BLOCK_N)
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    lo = split * tiles_per_split * BLOCK_N
    hi = tl.minimum(lo + tiles_per_split * BLOCK_N, context_len)

    offs_g = tl.arange(0, G_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_g  # the query heads of this kv head's group
    q_ptrs = q_ptr + seq.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    # An fp8 cache: the softmax scale and k_scale go into the queries, which are rounded to
    # the dots' dtype once anyway; a 16-bit cache's queries stay as given, scaled per score.
    q = fold_into_queries(q, qk_scale * k_scale, k_cache_ptr.dtype.element_ty)

    m_i = tl.full([G_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([G_PAD], dtype=tl.float32)
    acc = tl.zeros([G_PAD, BLOCK_D], dtype=tl.float32)

    bt_row_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    kv_base = kv_head * stride_ch
    for start in range(lo, hi, BLOCK_N):
        rows, n_mask = tile_rows(bt_row_ptr, kv_base, start, hi, offs_n, stride_cb, stride_cs,
                                 PAGE)
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        k = dequantize_kv(k, q.dtype)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if not k_cache_ptr.dtype.element_ty.is_fp8():
            qk = qk * qk_scale
        qk = tl.where(n_mask[None, :], qk, float("-inf"))
        # The first tile of a split always holds a valid key, so m_new is finite.
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        v = dequantize_kv(v, q.dtype)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)  # acc += p @ v
        m_i = m_new

    acc = acc * cache_scale(v_scale, v_cache_ptr.dtype.element_ty)  # sum p (s v) = s sum p v
    out_mask = g_mask[:, None] & d_mask[None, :]
    if NUM_SPLITS == 1:
        # l_i is 0 only for an empty context (a padding row): write zeros, not NaN.
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        o_ptrs = o_ptr + seq.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=out_mask)
    else:
        # Partial buffers are contiguous: index (seq, head, split[, d]).
        part = (seq.to(tl.int64) * (tl.num_programs(1) * GROUP) + heads) * NUM_SPLITS + split
        tl.store(m_part_ptr + part, m_i, mask=g_mask)
        tl.store(l_part_ptr + part, l_i, mask=g_mask)
        acc_ptrs = acc_part_ptr + part[:, None] * HEAD_DIM + offs_d[None, :]
        tl.store(acc_ptrs, acc, mask=out_mask)


@triton.jit
def _paged_decode_reduce_kernel(
    m_part_ptr,
    l_part_ptr,
    acc_part_ptr,
    o_ptr,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_wait(USE_PDL)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < NUM_SPLITS
    part = (seq.to(tl.int64) * tl.num_programs(1) + head) * NUM_SPLITS + offs_s
    m = tl.load(m_part_ptr + part, mask=s_mask, other=float("-inf"))
    l = tl.load(l_part_ptr + part, mask=s_mask, other=0.0)
    acc = tl.load(
        acc_part_ptr + part[:, None] * HEAD_DIM + offs_d[None, :],
        mask=s_mask[:, None] & (offs_d[None, :] < HEAD_DIM),
        other=0.0,
    )
    m_max = tl.max(m, 0)
    # Empty splits carry m = -inf; if all are empty (context 0), use 0 to avoid inf - inf.
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.math.exp2(m - m_max)  # 0 for empty splits
    l_total = tl.sum(w * l, 0)
    out = tl.sum(w[:, None] * acc, 0) / tl.where(l_total > 0.0, l_total, 1.0)
    o_ptrs = o_ptr + seq.to(tl.int64) * stride_ob + head * stride_oh + offs_d
    tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


# --- 3. The program for small GQA groups: scores on the CUDA cores -------------------
#
# The tensor-core program above pads the GROUP query heads of a kv head to the 16
# rows a tl.dot needs: with Qwen3-0.6B's 2 query heads a kv head, 7/8 of its dot products
# and of its softmax are padding. Over an fp8 cache, whose bytes take half as long to read as
# a bf16 cache's, that padded work per key is what bounds the kernel. This program does only
# the real heads' work, on the CUDA cores:
#
#     scores   s[n] = sum_d q[d] * k[n, d]          one query head at a time, q [D], k [N, D]
#     values   acc[n, :] += p[n] * v[n, :]           no reduction over the keys in the loop
#
# Each of the tile's BLOCK_N rows keeps its own online softmax (max m[n], sum l[n], acc[n, D])
# over the keys it meets (n, n + BLOCK_N, n + 2 BLOCK_N, ...), so the loop never reduces across
# rows, which would cost shared memory and a barrier per tile; the rows are merged once, after
# the loop, as split-K merges its splits. Per key and head the softmax takes one exp2: of the
# running max m and the new score s, the smaller one relative to the larger (1 for the larger).
#
# The scales are applied once per program, not per element: softmax scale * log2(e) and an fp8
# cache's k_scale multiply the float32 queries before the loop, v_scale the output after it.
# Each loaded tile is converted to float32 once and used by every head of the group. The loop
# is a tl.range with num_stages (LOAD_STAGES): Triton pipelines a loop's loads only when they
# feed a tl.dot or the loop names its stages, and with it the next tiles' K and V are copied to
# shared memory (cp.async) while this tile's arithmetic runs. (Prefetching them into registers
# by hand instead cost ~80 byte-shuffling instructions a tile: a loop-carried fp8 tile is held
# one byte a register.)
#
# Up to CUDA_CORES_MAX_GROUP query heads a kv head (their state is held in separate
# variables); larger groups take the tensor-core program, whose padding then costs little.

CUDA_CORES_MAX_GROUP = 4


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
    # Up to CUDA_CORES_MAX_GROUP heads' queries and states; those past GROUP are never
    # updated (the compiler drops them).
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


def cuda_cores_support_group(group: int) -> bool:
    """Whether this program can take a GQA group of `group` query heads a kv head."""
    return 1 <= group <= CUDA_CORES_MAX_GROUP

@dataclass(frozen=True)
class DecodeConfig:
    block_n: int  # keys a loop iteration reads
    num_warps: int
    num_stages: int
    keys_per_row: int = 1  # the CUDA-core program's keys per state row an iteration (1, 2)


# Split-K knobs: aim for this many programs per SM, and never cut a split shorter than
# MIN_TOKENS_PER_SPLIT tokens (below that the merge costs more than the parallelism gains).
PROGRAMS_PER_SM = 2
MIN_TOKENS_PER_SPLIT = 256
MAX_SPLITS = 32


@lru_cache(maxsize=None)
def num_sms(device_index: int) -> int:
    """SM count, queried once per device (a host-side property, no sync)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def choose_num_splits(batch: int, num_kv_heads: int, max_context: int, sm_count: int) -> int:
    """Number of split-K chunks per sequence, from shapes only (CUDA-graph safe).

    max_context is block_tables.shape[1] * block_size: what the table could hold, not what
    the sequences actually hold (that would need a device read). Rounded to a power of two
    so only a handful of kernel variants get compiled.
    """
    programs = batch * num_kv_heads
    target = PROGRAMS_PER_SM * sm_count
    if programs >= target:
        return 1
    wanted = triton.cdiv(target, programs)
    by_length = max(1, max_context // MIN_TOKENS_PER_SPLIT)
    splits = min(wanted, by_length, MAX_SPLITS)
    return 1 << (splits.bit_length() - 1)  # round down to a power of two


# How the decode kernel computes its scores: "dot" on the tensor cores (the GROUP query heads
# of a kv head padded to 16 rows, the program above), "cuda_cores" as products summed on the
# CUDA cores over the real heads only (section 3 above; groups of up to
# CUDA_CORES_MAX_GROUP heads, larger ones always take the dot), "auto" by the cache's
# dtype (AUTO_CUDA_CORES_MAX_GROUP). A module attribute, read at every call, so that a
# benchmark can compare both in one process (benchmarks/benchmark_decode_attention.py).
DECODE_SCORES = "auto"
SCORES_ALLOWED = ("auto", "dot", "cuda_cores")
# "auto": the largest group whose scores go to the CUDA cores, by the cache's bytes an
# element (0: always the dot). Change it here after a GPU run of the kernel benchmark.
AUTO_CUDA_CORES_MAX_GROUP = {1: 4, 2: 0, 4: 0}


def uses_cuda_cores(scores: str, group: int, cache_dtype: torch.dtype) -> bool:
    """Whether a decode call of this group over this cache runs the CUDA-core program."""
    if scores not in SCORES_ALLOWED:
        raise ValueError(f"paged_attention_decode: scores {scores!r} is not known; "
                         f"allowed: {', '.join(SCORES_ALLOWED)}")
    if not cuda_cores_support_group(group) or scores == "dot":
        return False
    return scores == "cuda_cores" or group <= AUTO_CUDA_CORES_MAX_GROUP.get(cache_dtype.itemsize, 0)


def decode_config(device: torch.device, head_dim: int,
                  cache_dtype: torch.dtype | None = None, *, cuda_cores: bool = False,
                  group: int = 1) -> DecodeConfig:
    """Tile size and warps (tuning knobs). Small tiles on the CPU interpreter keep tests fast.

    An fp8 cache gets 2 warps and a deeper pipeline: on the H200 at full-batch shapes that
    took its kernel from ~2.0 to ~2.4 TB/s (docs/diagnostics/decode_tile_sweep.py), while the
    bf16 cache's kernel reads at 90-96% of the copy bandwidth with any of the fast tiles.
    The CUDA-core program holds a [rows, D] float32 accumulator per query head; with 2 heads,
    16 rows meeting 2 keys each an iteration (32 keys, 4 warps) compile for sm_90 to 96
    registers and ~60 instructions a key per warp, against ~65 with one key a row; 4 heads
    take 230 registers at 16 keys. num_stages is its loop's load pipeline (tl.range). Not
    yet chosen from GPU timings: benchmarks/benchmark_decode_attention.py sweeps them.
    """
    if device.type != "cuda":
        return DecodeConfig(block_n=16, num_warps=4, num_stages=1)
    if cuda_cores and group <= 2:
        return DecodeConfig(block_n=32, num_warps=4, num_stages=3, keys_per_row=2)
    if cuda_cores:
        return DecodeConfig(block_n=16, num_warps=4, num_stages=3)
    if head_dim > 128:
        return DecodeConfig(block_n=32, num_warps=4, num_stages=2)
    if cache_dtype is not None and cache_dtype.itemsize == 1:
        return DecodeConfig(block_n=64, num_warps=2, num_stages=4)
    return DecodeConfig(block_n=64, num_warps=4, num_stages=3)


def paged_attention_decode_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    num_splits: int | None = None,
    config: DecodeConfig | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    scores: str | None = None,
) -> torch.Tensor:
    """Triton version of paged_attention_decode (contract in kernels/__init__.py).

    num_splits forces the split count (tests use it to exercise both paths); by default it
    comes from choose_num_splits. config overrides the tile size (tuning sweeps), scores the
    module's DECODE_SCORES (which program computes the scores: "auto", "dot", "cuda_cores").
    """
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"paged_attention_decode: num_heads={num_heads} over num_kv_heads="
                         f"{num_kv_heads}: allowed: num_heads a multiple of num_kv_heads")
    if k_cache.stride() != v_cache.stride():
        raise ValueError(f"paged_attention_decode: k_cache strides {k_cache.stride()}, v_cache "
                         f"strides {v_cache.stride()}: allowed: equal strides")
    if k_cache.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError(f"paged_attention_decode: last-axis strides q {q.stride(-1)}, caches "
                         f"{k_cache.stride(-1)}: allowed: 1 each (a contiguous head_dim axis)")
    o = torch.empty((batch, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if batch == 0:
        return o
    group = num_heads // num_kv_heads
    if num_splits is None:
        if q.device.type == "cuda":
            index = q.device.index if q.device.index is not None else torch.cuda.current_device()
            sms = num_sms(index)
        else:
            sms = 4  # the interpreter has no SMs; any small number keeps the grid tiny
        max_context = block_tables.shape[1] * block_size
        num_splits = choose_num_splits(batch, num_kv_heads, max_context, sms)
    if num_splits < 1:
        raise ValueError(f"paged_attention_decode: num_splits must be >= 1, got {num_splits}")
    cuda_cores = uses_cuda_cores(DECODE_SCORES if scores is None else scores, group,
                                 k_cache.dtype)
    cfg = config or decode_config(q.device, head_dim, k_cache.dtype, cuda_cores=cuda_cores,
                                  group=group)
    block_d = triton.next_power_of_2(head_dim)
    if num_splits > 1:
        # Allocated per call: inside a CUDA graph capture these come from the graph's pool.
        m_part = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=q.device)
        l_part = torch.empty_like(m_part)
        acc_part = torch.empty(
            (batch, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device
        )
    else:
        m_part = l_part = acc_part = o  # unused by the kernel in this mode
    args = (q, k_cache, v_cache, block_tables, context_lens, o, m_part, l_part, acc_part,
            scale * LOG2E, k_scale, v_scale,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            block_tables.stride(0), o.stride(0), o.stride(1))  # fmt: skip
    shape = dict(GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=cfg.block_n,
                 PAGE=block_size, NUM_SPLITS=num_splits, **pdl_args(q),
                 num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    grid = (batch, num_kv_heads, num_splits)
    if cuda_cores:
        paged_decode_cuda_cores_kernel[grid](*args, LOAD_STAGES=cfg.num_stages,
                                             KEYS_PER_ROW=cfg.keys_per_row, **shape)
    else:
        _paged_decode_split_kernel[grid](
            *args, G_PAD=max(16, triton.next_power_of_2(group)),
            DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", **shape)
    if num_splits > 1:
        _paged_decode_reduce_kernel[(batch, num_heads)](
            m_part, l_part, acc_part, o, o.stride(0), o.stride(1),
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            NUM_SPLITS=num_splits,
            SPLITS_PAD=max(2, triton.next_power_of_2(num_splits)),
            **pdl_args(q),
            num_warps=4,
        )  # fmt: skip
    return o
