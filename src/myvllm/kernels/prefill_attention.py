"""Triton kernel: causal varlen FlashAttention for prefill (contiguous or paged K/V).

Grid: (query tiles, query heads, sequences). One program owns BLOCK_M query rows of one head
of one sequence (a decode step in batch-invariant mode: the query heads of one KV head, for
one token; decode_with_prefill_kernel) and streams that sequence's K/V in BLOCK_N tiles,
keeping the softmax "online" (running max m, running sum l, un-normalised output acc, all
float32):

    keys ->      0        BLOCK_N     2*BLOCK_N   ...                   seqlen_k
    query tile  [ full    | full      | full  |diag\\ ]  <- only tiles crossing the diagonal
    (rows m0 ..  m0+BLOCK_M-1)                        \\     need the causal mask; tiles
                                                           right of it are never loaded

Queries are the LAST seqlen_q of seqlen_k context positions (a cached prefix precedes them
when seqlen_k > seqlen_q), so query row i sits at absolute position seqlen_k - seqlen_q + i
and may see keys 0 .. that position.

Softmax uses exp2: scores are multiplied by scale * log2(e) once, and exp(x) = exp2(x *
log2(e)) so the maths is unchanged while the GPU's native exp2 is used.

With a TileMap (build_tile_map; the CUDA graphs of chunked steps) the grid is instead one
program per map row and head, fixed by the step's padded size: each program reads which
(sequence, query tile) it computes, and a tile that sees many keys may be cut into splits
along its keys, each leaving a partial (acc, m, l) that _combine_splits_kernel merges.

On Hopper, contiguous Q/K/V tiles are fetched through TMA tensor descriptors (the copy engine
moves a whole [rows, D] tile; see PrefillConfig.use_tma); elsewhere, and for the paged gather,
through per-element pointers. Both paths compute the same thing and are tested. An fp8 cache's
tiles (paged K/V only: contiguous K/V are the model's dtype) are cast as they are loaded, their
scales applied to the scores and probabilities (fp8_kv.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache

import torch
import triton
import triton.language as tl

from .fp8_kv import cache_scale, dequantize_kv, queries_for_cache, scale_probs

# The map of a fixed-grid launch is built on the host, in tile_map.py (no Triton needed there).
from .tile_map import TileMap

try:  # host-side TMA descriptors (triton >= 3.4)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older triton: pointer loads only
    TensorDescriptor = None

LOG2E = math.log2(math.e)


@triton.jit
def _load_kv_tile(ptrs, n_mask, d_mask, MASKED: tl.constexpr, EVEN_D: tl.constexpr):
    # Full tiles of a power-of-two head_dim load without any mask (the cheapest path).
    if MASKED:
        tile = tl.load(ptrs, mask=n_mask[:, None] & d_mask[None, :], other=0.0)
    elif EVEN_D:
        tile = tl.load(ptrs)
    else:
        tile = tl.load(ptrs, mask=d_mask[None, :], other=0.0)
    return tile


@triton.jit
def _attn_tile_loop(
    acc,
    l_i,
    m_i,
    q,
    k_base,
    v_base,
    k_desc,
    v_desc,
    kv_col,
    bt_row_ptr,
    seq_k_start,
    offs_n,
    offs_d,
    d_mask,
    q_pos,
    lo,
    hi,
    seqlen_k,
    qk_scale,
    v_scale,
    stride_kn,
    stride_vn,
    stride_cb,
    BLOCK_N: tl.constexpr,
    PAGED: tl.constexpr,
    PAGE: tl.constexpr,
    MASKED: tl.constexpr,
    EVEN_D: tl.constexpr,
    USE_TMA: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        pos = start_n + offs_n  # key positions inside this sequence
        n_mask = pos < seqlen_k
        if PAGED:
            # Block table looked up per key: position p -> (block, offset) of the cache.
            if MASKED:
                blk = tl.load(bt_row_ptr + pos // PAGE, mask=n_mask, other=0)
            else:
                blk = tl.load(bt_row_ptr + pos // PAGE)
            blk = blk.to(tl.int64)
            k_row = blk * stride_cb + (pos % PAGE) * stride_kn
            v_row = blk * stride_cb + (pos % PAGE) * stride_vn
        else:
            k_row = (seq_k_start + pos).to(tl.int64) * stride_kn
            v_row = (seq_k_start + pos).to(tl.int64) * stride_vn
        k_ptrs = k_base + k_row[:, None] + offs_d[None, :]
        v_ptrs = v_base + v_row[:, None] + offs_d[None, :]
        if USE_TMA:
            # Hopper's copy engine fetches the [BLOCK_N, D] tile; rows past the sequence
            # (the next sequence's, or zero padding) are hidden by the mask below.
            k = k_desc.load([seq_k_start + start_n, kv_col])
        else:
            k = _load_kv_tile(k_ptrs, n_mask, d_mask, MASKED, EVEN_D)
        k = dequantize_kv(k, q.dtype)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if MASKED:
            visible = (pos[None, :] <= q_pos[:, None]) & n_mask[None, :]
            qk = qk * qk_scale + tl.where(visible, 0.0, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            qk = qk - m_new[:, None]
        else:
            # scale > 0, so max(qk) * scale == max(qk * scale); then one FMA per score.
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            qk = qk * qk_scale - m_new[:, None]
        # m_new is finite: every row sees key 0 in its first tile, and a later tile that
        # hides all of a row's keys leaves that row's (finite) running max unchanged.
        p = tl.math.exp2(qk)
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if USE_TMA:
            v = v_desc.load([seq_k_start + start_n, kv_col])
        else:
            v = _load_kv_tile(v_ptrs, n_mask, d_mask, MASKED, EVEN_D)
        p = scale_probs(p, v_scale, v.dtype)
        v = dequantize_kv(v, q.dtype)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)  # acc += p @ v
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _flash_attn_varlen_kernel(
    q_ptr,
    k_ptr,  # k, or k_cache when PAGED
    v_ptr,
    o_ptr,
    q_desc,  # TMA descriptors of q/k/v as [tokens, heads * D] (USE_TMA only)
    k_desc,
    v_desc,
    cu_seqlens_q_ptr,  # [sequences + 1] (not read under DECODE)
    cu_seqlens_k_ptr,  # [sequences + 1]; under DECODE each sequence's key count, [sequences]
    block_tables_ptr,
    tile_map_ptr,  # [rows, 5] int32 per program (TILE_MAP only; see build_tile_map)
    part_acc_ptr,  # [parts, heads, BLOCK_M, BLOCK_D] float32: a split's un-normalised output
    part_ml_ptr,  # [parts, heads, BLOCK_M, 2] float32: its running max and sum
    qk_scale,  # softmax scale * log2(e)
    k_scale,  # fp8 cache: K = stored * k_scale (folded into qk_scale; unused otherwise)
    v_scale,
    stride_qn,
    stride_qh,
    stride_kn,  # per token (contiguous) or per slot-in-block (paged)
    stride_kh,
    stride_vn,
    stride_vh,
    stride_on,
    stride_oh,
    stride_cb,  # cache stride per block (paged only)
    stride_bt,  # block_tables row stride (paged only)
    GROUP: tl.constexpr,  # query heads per kv head
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # HEAD_DIM rounded up to a power of two
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGED: tl.constexpr,
    PAGE: tl.constexpr,  # cache block size (tokens); 1 when not paged
    USE_TMA: tl.constexpr,  # contiguous K/V on sm_90+: tiles via tensor descriptors
    TILE_MAP: tl.constexpr,  # programs read their (sequence, query tile) from tile_map
    DOT_PRECISION: tl.constexpr,
    BATCH_INVARIANT: tl.constexpr,  # every key tile through the masked loop (see below)
    DECODE: tl.constexpr,  # one new token per sequence, its keys all paged (see below)
):
    head = tl.program_id(1)  # the query head; under DECODE the KV head
    if TILE_MAP:
        # A grid fixed by the step's padded token count (a CUDA graph replays it): the host
        # listed the tiles that exist, heaviest first; slots past them hold sequence -1.
        row = tile_map_ptr + 5 * tl.program_id(0)
        seq = tl.load(row)
        if seq < 0:
            return
        start_m = tl.load(row + 1)
        split = tl.load(row + 2)  # this program's share of the tile's keys (split-K) ...
        num_splits = tl.load(row + 3)  # ... out of num_splits
        part = tl.load(row + 4)  # where a split leaves its partial result; -1 = not split
    else:
        # Heaviest query tiles (the last ones: they see the most keys) are launched first, so
        # the short tiles fill the gaps at the end instead of a long tile running alone.
        start_m = tl.num_programs(0) - 1 - tl.program_id(0)
        seq = tl.program_id(2)
        split = 0
        num_splits = 1
        part = -1
    m0 = start_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    if DECODE:
        # One program per (KV head, sequence) (decode_with_prefill_kernel): the tile's rows
        # are the KV head's GROUP query heads, each sequence seq's one token at position
        # context_len - 1, seeing every key before it, so each K/V tile is read once for the
        # group. A row's scores, softmax and P @ V are its own (a dot's output element comes
        # from its row and column only), over the same key tiles in the same order as the
        # same row alone in a tile of the varlen path: the same bits. The boundaries a varlen
        # batch reads from cu_seqlens are known here: no kernel has to build them first.
        tl.static_assert(BATCH_INVARIANT, "DECODE runs the batch-invariant (masked) loop only")
        kv_head = head
        seqlen_k = tl.load(cu_seqlens_k_ptr + seq)
        k_start = 0  # the keys are found through the block table
        m_mask = offs_m < GROUP
        q_heads = (kv_head * GROUP + offs_m).to(tl.int64)
        q_rows_off = seq.to(tl.int64) * stride_qn + q_heads * stride_qh
        o_rows_off = seq.to(tl.int64) * stride_on + q_heads * stride_oh
        q_pos = seqlen_k - 1 + 0 * offs_m  # every row at the sequence's last position
        first_pos = seqlen_k - 1  # the position of the tile's first row
        q = tl.load(q_ptr + q_rows_off[:, None] + offs_d[None, :],
                    mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    else:
        kv_head = head // GROUP
        q_start = tl.load(cu_seqlens_q_ptr + seq)
        seqlen_q = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
        k_start = tl.load(cu_seqlens_k_ptr + seq)
        seqlen_k = tl.load(cu_seqlens_k_ptr + seq + 1) - k_start
        if m0 >= seqlen_q:
            return  # this sequence is shorter than the longest one; nothing to do here
        m_mask = offs_m < seqlen_q
        q_rows = (q_start + offs_m).to(tl.int64)
        q_rows_off = q_rows * stride_qn + head * stride_qh
        o_rows_off = q_rows * stride_on + head * stride_oh
        ctx_offset = seqlen_k - seqlen_q  # cached prefix length
        q_pos = ctx_offset + offs_m  # absolute position of each query row
        first_pos = ctx_offset + m0
        if USE_TMA:
            q = q_desc.load([q_start + m0, head * HEAD_DIM])  # extra rows are never stored
        else:
            q = tl.load(q_ptr + q_rows_off[:, None] + offs_d[None, :],
                        mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    q = queries_for_cache(q, k_ptr.dtype.element_ty)

    # Keys [0, full_end) are visible to every row of the tile: no mask needed there.
    # Batch-invariant mode: none. Whether a key tile is "full" depends on where the query
    # tile starts (a cached prefix, a chunk boundary, a decode row), and the unmasked loop
    # rounds differently (qk * scale - m as one FMA), so a row's bits would depend on it.
    # Through the masked loop alone, a row reduces the same key tiles [0, BLOCK_N), ...
    # with the same arithmetic wherever it sits; tiles past its position are fully masked
    # for it and leave its m, l and acc exactly unchanged (p = 0, alpha = 1).
    if BATCH_INVARIANT:
        full_end = 0
    else:
        full_end = ((first_pos + 1) // BLOCK_N) * BLOCK_N
    # The last key any row of this tile may see (rows past seqlen_q are clipped).
    hi = tl.minimum(first_pos + BLOCK_M, seqlen_k)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # Split-K: split s of n takes an equal share of the unmasked key tiles [0, full_end); the
    # last split also takes the diagonal tiles [full_end, hi), so every split sees key 0 of
    # its range in full and its running max stays finite.
    per_split = tl.cdiv(full_end // BLOCK_N, num_splits) * BLOCK_N
    lo = split * per_split
    full_hi = tl.minimum(lo + per_split, full_end)
    diag_lo = tl.where(split == num_splits - 1, full_end, hi)  # an empty range unless last

    k_base = k_ptr + kv_head * stride_kh
    v_base = v_ptr + kv_head * stride_vh
    bt_row_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    qk_scale = qk_scale * cache_scale(k_scale, k_ptr.dtype.element_ty)
    acc, l_i, m_i = _attn_tile_loop(
        acc, l_i, m_i, q, k_base, v_base, k_desc, v_desc, kv_head * HEAD_DIM, bt_row_ptr,
        k_start, offs_n, offs_d, d_mask, q_pos, lo, full_hi, seqlen_k, qk_scale,
        v_scale, stride_kn, stride_vn, stride_cb, BLOCK_N, PAGED, PAGE, False,
        BLOCK_D == HEAD_DIM, USE_TMA, DOT_PRECISION,
    )  # fmt: skip
    acc, l_i, m_i = _attn_tile_loop(
        acc, l_i, m_i, q, k_base, v_base, k_desc, v_desc, kv_head * HEAD_DIM, bt_row_ptr,
        k_start, offs_n, offs_d, d_mask, q_pos, diag_lo, hi, seqlen_k, qk_scale,
        v_scale, stride_kn, stride_vn, stride_cb, BLOCK_N, PAGED, PAGE, True,
        BLOCK_D == HEAD_DIM, USE_TMA, DOT_PRECISION,
    )  # fmt: skip

    if part >= 0:  # one split of several: _combine_splits_kernel finishes the tile
        rows_m = tl.arange(0, BLOCK_M)
        base = (part.to(tl.int64) * tl.num_programs(1) + head) * BLOCK_M
        tl.store(part_acc_ptr + (base + rows_m[:, None]) * BLOCK_D + offs_d[None, :], acc)
        tl.store(part_ml_ptr + (base + rows_m) * 2, m_i)
        tl.store(part_ml_ptr + (base + rows_m) * 2 + 1, l_i)
    else:
        # l_i is 0 only for a row with no keys (a padding decode row): zeros, not NaN.
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        o_ptrs = o_ptr + o_rows_off[:, None] + offs_d[None, :]
        tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty),
                 mask=m_mask[:, None] & d_mask[None, :])


@triton.jit
def _combine_splits_kernel(
    o_ptr,
    part_acc_ptr,
    part_ml_ptr,
    combine_map_ptr,  # [rows, 4] int32: (sequence, query tile, splits, first part); -1 = none
    cu_seqlens_q_ptr,
    stride_on,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """Merge the splits of one query tile of one head: each split s left (acc_s, m_s, l_s)
    over its keys; with m = max m_s, o = sum(acc_s * 2^(m_s - m)) / sum(l_s * 2^(m_s - m))."""
    row = combine_map_ptr + 4 * tl.program_id(0)
    seq = tl.load(row)
    if seq < 0:
        return
    start_m = tl.load(row + 1)
    num_splits = tl.load(row + 2)
    first = tl.load(row + 3)
    head = tl.program_id(1)
    rows_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    for s in range(num_splits):
        base = ((first + s).to(tl.int64) * tl.num_programs(1) + head) * BLOCK_M
        m = tl.maximum(m, tl.load(part_ml_ptr + (base + rows_m) * 2))
    l = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for s in range(num_splits):
        base = ((first + s).to(tl.int64) * tl.num_programs(1) + head) * BLOCK_M
        w = tl.math.exp2(tl.load(part_ml_ptr + (base + rows_m) * 2) - m)
        l += w * tl.load(part_ml_ptr + (base + rows_m) * 2 + 1)
        acc += w[:, None] * tl.load(part_acc_ptr + (base + rows_m[:, None]) * BLOCK_D
                                    + offs_d[None, :])
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    seqlen_q = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    offs_m = start_m * BLOCK_M + rows_m
    o_rows = (q_start + offs_m).to(tl.int64)
    o_ptrs = o_ptr + o_rows[:, None] * stride_on + head * stride_oh + offs_d[None, :]
    mask = (offs_m < seqlen_q)[:, None] & (offs_d < HEAD_DIM)[None, :]
    tl.store(o_ptrs, (acc / l[:, None]).to(o_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class PrefillConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    # Load contiguous Q/K/V tiles with tensor descriptors (Hopper's TMA copy engine) instead
    # of per-element pointers. Used only where allowed (see _tma_ok); paged K/V is a gather
    # through the block table, which TMA on sm_90 cannot do, so it always uses pointers.
    use_tma: bool = False


@lru_cache(maxsize=None)
def _gpu_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def prefill_config(device: torch.device, head_dim: int,
                   dtype: torch.dtype = torch.bfloat16) -> PrefillConfig:
    """Tile sizes by device and head_dim (tuning knobs; see docs/benchmarks.md for numbers).

    On the CPU interpreter every program is executed in NumPy, so small tiles keep tests fast.
    On Hopper (sm_90), hd 128: a 128x128 tile with 8 warps, 3 stages and TMA loads (Q 32 KB
    + 3 x 64 KB of K/V fits the 228 KB of shared memory) was the fastest or tied of sweeps
    over BLOCK_M {64,128} x BLOCK_N {32,64,128} x warps {4,8} x stages {2,3,4} at 8k-16k
    tokens on an H200 (benchmark_prefilling.py --sweep). Other GPUs get conservative tiles
    that were not tuned.
    """
    if device.type != "cuda":
        return PrefillConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)
    major, _ = _gpu_capability(device.index if device.index is not None else 0)
    if dtype.itemsize > 2:
        # fp32 tiles take twice the shared memory of bf16 ones: the Hopper 128x128 tiles
        # would need 320 KB (the limit is 227 KB). fp32 is for exactness checks, not speed.
        return PrefillConfig(block_m=64, block_n=32, num_warps=4, num_stages=2)
    if head_dim > 128:
        return PrefillConfig(block_m=64, block_n=32, num_warps=8, num_stages=2)
    if major >= 9:
        if head_dim <= 64:
            return PrefillConfig(block_m=128, block_n=64, num_warps=4, num_stages=3, use_tma=True)
        return PrefillConfig(block_m=128, block_n=128, num_warps=8, num_stages=3, use_tma=True)
    if major >= 8:
        return PrefillConfig(block_m=128, block_n=32 if head_dim > 64 else 64, num_warps=4,
                             num_stages=2)  # fmt: skip
    return PrefillConfig(block_m=64, block_n=32, num_warps=4, num_stages=1)


def decode_tile_config(device: torch.device, head_dim: int,
                       dtype: torch.dtype = torch.bfloat16) -> PrefillConfig:
    """The prefill kernel's tiles for decode rows in batch-invariant mode
    (decode_with_prefill_kernel): prefill_config's, with a query tile of at most 64 rows.

    Why this is free: a row's bits depend on the key tiles (BLOCK_N, from key 0, every tile
    through the masked loop) and on each dot's instruction, not on how many query rows share
    the tile. A decode step fills a tile's rows with one KV head's query heads (its GQA
    group: 2 rows for Qwen3-0.6B); 64 rows on 4 warps is the smallest tile that keeps the
    128-row tile's instruction on a GPU (on Hopper one warpgroup's 64-row wgmma, of which the
    128-row tile on 8 warps runs two; below 64 rows Triton would switch to another
    instruction, whose sums are not promised to round alike). Half the work of a 128-row
    tile for the group; the key tile, and so the order, unchanged.
    """
    cfg = prefill_config(device, head_dim, dtype)
    if device.type != "cuda" or cfg.block_m <= 64:
        return cfg
    return replace(cfg, block_m=64, num_warps=4, use_tma=False)


def flash_attention_varlen_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    scale: float,
    block_tables: torch.Tensor | None = None,
    k_cache: torch.Tensor | None = None,
    v_cache: torch.Tensor | None = None,
    tile_map: TileMap | None = None,
    out: torch.Tensor | None = None,
    *,
    config: PrefillConfig | None = None,
    batch_invariant: bool = False,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Triton version of flash_attention_varlen (contract in kernels/__init__.py).

    `tile_map` (from build_tile_map with this config's block_m and block_n) fixes the grid
    at one program per row per head whatever the batch, so a CUDA graph can replay it.
    `out` ([tokens, heads, D]) receives the output instead of a new tensor.
    `config` overrides the tile sizes (benchmarks and tuning sweeps use it).
    `batch_invariant` (kernels/batch_invariant.py): a row's result the same bits whatever
    its batch, cached prefix or chunk; a tile_map must then split no tile (build_tile_map
    with split_key_tiles=None), as a split's merge would change the order.
    """
    del max_seqlen_k  # the kernel reads each sequence's K length from cu_seqlens_k
    num_tokens, num_heads, head_dim = q.shape
    o = (out if out is not None
         else torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device))
    batch = cu_seqlens_q.shape[0] - 1
    if num_tokens == 0 or batch == 0 or (max_seqlen_q == 0 and tile_map is None):
        return o
    paged = block_tables is not None
    if block_tables is not None:
        if k_cache is None or v_cache is None:
            raise ValueError("flash_attention_varlen: block_tables given, but k_cache or v_cache "
                             "is None: allowed: block_tables with both caches (paged K/V)")
        kk, vv = k_cache, v_cache
        stride_kn, stride_kh = k_cache.stride(1), k_cache.stride(2)
        stride_vn, stride_vh = v_cache.stride(1), v_cache.stride(2)
        stride_cb, stride_bt, page = k_cache.stride(0), block_tables.stride(0), k_cache.shape[1]
        bt = block_tables
    else:
        kk, vv = k, v
        stride_kn, stride_kh = k.stride(0), k.stride(1)
        stride_vn, stride_vh = v.stride(0), v.stride(1)
        stride_cb, stride_bt, page = 0, 0, 1
        bt = cu_seqlens_q  # never read; any device pointer will do
    group = _check_inputs("flash_attention_varlen", q, kk, vv, scale, paged=paged)
    cfg = config or prefill_config(q.device, head_dim, q.dtype)
    # Batch-invariant: pointer loads only, as the paged path (cached keys) must use.
    use_tma = cfg.use_tma and not paged and not batch_invariant and _tma_ok(q, k, v)
    if use_tma:
        q_desc = _row_descriptor(q, cfg.block_m)
        k_desc, v_desc = _row_descriptor(k, cfg.block_n), _row_descriptor(v, cfg.block_n)
    else:
        q_desc, k_desc, v_desc = q, kk, vv  # placeholders, never used by the kernel
    block_d = triton.next_power_of_2(head_dim)
    if tile_map is not None:
        grid = (tile_map.rows.shape[0], num_heads, 1)
        # Scratch for the splits' partial results (from the CUDA graph's pool when captured).
        part_acc = torch.empty(tile_map.num_parts, num_heads, cfg.block_m, block_d,
                               dtype=torch.float32, device=q.device)
        part_ml = torch.empty(tile_map.num_parts, num_heads, cfg.block_m, 2,
                              dtype=torch.float32, device=q.device)
    else:
        grid = (triton.cdiv(max_seqlen_q, cfg.block_m), num_heads, batch)
        part_acc = part_ml = o  # never read without TILE_MAP
    _flash_attn_varlen_kernel[grid](
        q, kk, vv, o, q_desc, k_desc, v_desc, cu_seqlens_q, cu_seqlens_k, bt,
        tile_map.rows if tile_map is not None else cu_seqlens_q,  # read only with TILE_MAP
        part_acc, part_ml,
        scale * LOG2E, k_scale, v_scale,
        q.stride(0), q.stride(1), stride_kn, stride_kh, stride_vn, stride_vh,
        o.stride(0), o.stride(1), stride_cb, stride_bt,
        **_launch_constants(cfg, q, group),
        PAGED=paged,
        PAGE=page,
        USE_TMA=use_tma,
        TILE_MAP=tile_map is not None,
        BATCH_INVARIANT=batch_invariant,
        DECODE=False,
    )  # fmt: skip
    if tile_map is not None and tile_map.combine.shape[0]:
        _combine_splits_kernel[(tile_map.combine.shape[0], num_heads)](
            o, part_acc, part_ml, tile_map.combine, cu_seqlens_q, o.stride(0), o.stride(1),
            HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=cfg.block_m,
            num_warps=4,
        )  # fmt: skip
    return o


def _check_inputs(caller: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  scale: float, *, paged: bool) -> int:
    """The checks of both launches (k/v: the caches when paged); -> query heads per KV head."""
    num_heads, num_kv_heads = q.shape[1], k.shape[-2]
    k_name, v_name = ("k_cache", "v_cache") if paged else ("k", "v")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"{caller}: num_heads={num_heads} over num_kv_heads={num_kv_heads}: "
                         "allowed: num_heads a multiple of num_kv_heads")
    if paged and k.stride() != v.stride():
        raise ValueError(f"{caller}: k_cache strides {k.stride()}, v_cache strides "
                         f"{v.stride()}: allowed: equal strides")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError(f"{caller}: last-axis strides q {q.stride(-1)}, {k_name} "
                         f"{k.stride(-1)}, {v_name} {v.stride(-1)}: allowed: 1 each (a "
                         "contiguous head_dim axis)")
    if not scale > 0:
        raise ValueError(f"{caller}: scale={scale!r}: allowed: a float > 0")
    return num_heads // num_kv_heads


def _launch_constants(cfg: PrefillConfig, q: torch.Tensor, group: int) -> dict[str, object]:
    """The kernel's launch arguments that both launches (a prefill, a decode step) take alike:
    the tiles and warps of cfg, the head's shape and the dots' precision. Each launch names
    its own: PAGED, PAGE, USE_TMA, TILE_MAP, BATCH_INVARIANT and DECODE."""
    head_dim = q.shape[-1]
    return {
        "GROUP": group,
        "HEAD_DIM": head_dim,
        "BLOCK_D": triton.next_power_of_2(head_dim),
        "BLOCK_M": cfg.block_m,
        "BLOCK_N": cfg.block_n,
        "DOT_PRECISION": "ieee" if q.dtype == torch.float32 else "tf32",
        "num_warps": cfg.num_warps,
        "num_stages": cfg.num_stages,
    }


def _tma_ok(*tensors: torch.Tensor) -> bool:
    """A tensor descriptor views x [tokens, heads, D] as a 2-D [tokens, heads * D] matrix, so
    heads must be packed (stride D), D a power of two, and the base address and row stride
    16-byte aligned (TMA's rules)."""
    if TensorDescriptor is None:
        return False
    for x in tensors:
        d = x.shape[-1]
        if x.stride(1) != d or d & (d - 1) or x.shape[0] == 0:
            return False
        if x.data_ptr() % 16 or (x.stride(0) * x.element_size()) % 16:
            return False
    return True


def _row_descriptor(x: torch.Tensor, block_rows: int) -> TensorDescriptor:
    tokens, heads, d = x.shape
    return TensorDescriptor(x, shape=[tokens, heads * d], strides=[x.stride(0), 1],
                            block_shape=[block_rows, d])  # fmt: skip


def decode_with_prefill_kernel(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor,
                               scale: float, k_scale: float = 1.0,
                               v_scale: float = 1.0, *,
                               config: PrefillConfig | None = None) -> torch.Tensor:
    """paged_attention_decode's contract, computed by the prefill kernel in batch-invariant
    mode: each row is a sequence of one new token whose context_lens[b] keys are all in the
    cache. A decode row then reduces its keys exactly as the prefill or chunk row at the same
    position did (the decode kernel's tiles and splits differ).

    What it costs: one launch and nothing before it (under the kernel's DECODE flag row b's
    query is row b and its key count context_lens[b], read in the kernel: no cu_seqlens to
    build). One program per (KV head, sequence) puts the head's group of query heads in its
    query tile's rows (2 of 64 for Qwen3-0.6B's 16 over 8; decode_tile_config: 64 rows, not
    the prefill's 128) and reads each K/V tile once for the group; the tile's other rows are
    padding, which its dots compute all the same (the decode kernel pads a group to 16).

    CUDA-graph safe: the grid is (tiles of the group, KV heads, batch), from shapes only.
    Rows with context 0 (padding) give zeros. `config` overrides the tiles (the tests run
    several query tiles; its block_n must be the prefill's)."""
    batch, num_heads, head_dim = q.shape
    o = torch.empty((batch, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if batch == 0:
        return o
    group = _check_inputs("paged_attention_decode", q, k_cache, v_cache, scale, paged=True)
    if context_lens.shape != (batch,) or context_lens.stride(0) != 1:
        raise ValueError(f"paged_attention_decode: context_lens of shape "
                         f"{tuple(context_lens.shape)}, stride {context_lens.stride()}: "
                         f"allowed: a contiguous [{batch}] tensor (one length per row of q)")
    cfg = config or decode_tile_config(q.device, head_dim, q.dtype)
    num_kv_heads = k_cache.shape[2]
    grid = (triton.cdiv(group, cfg.block_m), num_kv_heads, batch)
    _flash_attn_varlen_kernel[grid](
        q, k_cache, v_cache, o, q, k_cache, v_cache,  # no TMA descriptors: placeholders
        context_lens, context_lens, block_tables,  # cu_seqlens_q is not read under DECODE
        context_lens, o, o,  # no tile map, no splits: never read
        scale * LOG2E, k_scale, v_scale,
        q.stride(0), q.stride(1), k_cache.stride(1), k_cache.stride(2), v_cache.stride(1),
        v_cache.stride(2), o.stride(0), o.stride(1), k_cache.stride(0), block_tables.stride(0),
        **_launch_constants(cfg, q, group),
        PAGED=True,
        PAGE=k_cache.shape[1],
        USE_TMA=False,
        TILE_MAP=False,
        BATCH_INVARIANT=True,
        DECODE=True,
    )  # fmt: skip
    return o
