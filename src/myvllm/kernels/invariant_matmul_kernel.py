"""Triton kernels: y = x W^T (+ b) whose every row is the same whatever the row count.

cuBLAS picks its kernel by shape: at a few rows it may split K over several thread blocks
and add their partial sums, at many rows it tiles differently, so one row of x times W gives
bits that depend on how many rows came with it. What decides an output element's bits is
only the order of its sum over K, so that order is fixed here, and everything else is free
to follow the shape:

    K is cut into chunks of CHUNK_K (512) elements from 0; chunk c's partial of an element is

        part_c = 0 (float32)
        for k0 in c*CHUNK_K, +BLOCK_K, ... (< min((c+1)*CHUNK_K, K)):
            part_c = dot(x[row, k0:k0+BLOCK_K], W[col, k0:k0+BLOCK_K], part_c)

    and the element is  ((0 + part_0) + part_1) + ... (+ bias), rounded once to x's dtype.

Two plans compute exactly that, with the same chunk code (_chunk_partial):

    "tiles"  (prefill: many rows)  program (m, n) walks the chunks in order and adds each
             partial to its running sum in registers.
    "split"  (decode: few rows, too few (m, n) tiles to fill the GPU)  program (m, n, c)
             computes part_c alone and stores it (float32, exact); the last program of the
             tile to finish (an atomic counter says which) loads part_0, part_1, ... in that
             order and adds them as "tiles" does. Which program is last changes from run to
             run; the order it adds in does not.

A row's bits do not depend on the row tile (BLOCK_M, 64 or 128 rows, chosen by shape) nor on
its place in it: one tl.dot computes each output element from its own row and column only,
with the same instruction for both row tiles (on Hopper a warpgroup's 64-row wgmma of the
same BLOCK_N and BLOCK_K; BLOCK_N and BLOCK_K never change). A split with a fixed chunk size
in elements, not a fixed number of splits, keeps the order of the sum whatever the shape (the
idea is from Thinking Machines' "Defeating Nondeterminism in LLM Inference", 2025).

M is not specialised by Triton (do_not_specialize): the same compiled kernel runs for 1 row
and for 4,096.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
import triton
import triton.language as tl


@triton.jit
def _chunk_partial(x_ptrs, w_ptrs, m_mask, n_mask, offs_k, c0, K,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   CHUNK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """part_c of the [BLOCK_M, BLOCK_N] tile over keys c0 .. c0 + CHUNK_K (clipped at K):
    the same code, hence the same bits, in both plans."""
    part = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(c0, tl.minimum(c0 + CHUNK_K, K), BLOCK_K):
        k_mask = (k0 + offs_k) < K  # the last tile's columns past K load as 0: add 0
        x = tl.load(x_ptrs + k0, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs + k0, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        part = tl.dot(x, tl.trans(w), part, input_precision=DOT_PRECISION)
    return part


@triton.jit
def _store_output(acc, bias_ptr, out_ptr, offs_m, offs_n, m_mask, n_mask, N,
                  HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit(do_not_specialize=["M"])
def _invariant_matmul_kernel(
    x_ptr,  # [M, K], contiguous K
    w_ptr,  # [N, K], contiguous K
    bias_ptr,  # [N] when HAS_BIAS
    out_ptr,  # [M, N] contiguous
    part_ptr,  # "split": [chunks, M, N] float32, each chunk's partial
    count_ptr,  # "split": [tiles] int32, zero between launches: finished chunks per tile
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr,  # the "split" plan: axis 2 of the grid is the chunk
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    CHUNK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    if SPLIT:
        chunk = tl.program_id(2)
        num_chunks = tl.num_programs(2)
        part = _chunk_partial(x_ptrs, w_ptrs, m_mask, n_mask, offs_k, chunk * CHUNK_K, K,
                              BLOCK_M, BLOCK_N, BLOCK_K, CHUNK_K, DOT_PRECISION)
        mn = offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
        mn_mask = m_mask[:, None] & n_mask[None, :]
        size = M.to(tl.int64) * N
        tl.store(part_ptr + chunk * size + mn, part, mask=mn_mask)
        # acq_rel: this program's partial is visible before its count, and the last one
        # sees every partial that was counted before its own.
        tile = pid_m * tl.num_programs(1) + pid_n
        done = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel")
        if done == num_chunks - 1:  # the tile's last chunk: sum the partials in order
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for c in range(0, num_chunks):
                # .cg: from L2, where the other programs' stores are (not a stale L1 line)
                acc += tl.load(part_ptr + c * size + mn, mask=mn_mask, other=0.0,
                               cache_modifier=".cg")
            _store_output(acc, bias_ptr, out_ptr, offs_m, offs_n, m_mask, n_mask, N, HAS_BIAS)
            tl.atomic_xchg(count_ptr + tile, 0)  # zero again for the next launch
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for c0 in range(0, K, CHUNK_K):
            acc += _chunk_partial(x_ptrs, w_ptrs, m_mask, n_mask, offs_k, c0, K,
                                  BLOCK_M, BLOCK_N, BLOCK_K, CHUNK_K, DOT_PRECISION)
        _store_output(acc, bias_ptr, out_ptr, offs_m, offs_n, m_mask, n_mask, N, HAS_BIAS)


@dataclass(frozen=True)
class MatmulConfig:
    """The tiling per device and dtype. block_n, block_k and chunk_k fix every element's sum
    and never change with the shape; the row tile is block_m (many rows) or small_block_m
    (few rows), whichever fills the GPU (matmul_plan)."""

    block_m: int
    small_block_m: int
    block_n: int
    block_k: int
    chunk_k: int
    num_warps: int
    small_num_warps: int
    num_stages: int


def matmul_config(device: torch.device, dtype: torch.dtype) -> MatmulConfig:
    """GPU, 16-bit: 128 x 128 output tiles over K tiles of 64, 8 warps (the tile of Triton's
    matmul tutorial and of vLLM's batch-invariant matmul on Hopper), or 64 x 128 on 4 warps
    (one warpgroup: the same 64-row wgmma per warpgroup as the 128-row tile's two); chunks of
    512 (8 K tiles). fp32 tiles take twice the shared memory, so they are halved. The CPU
    interpreter gets small tiles (it runs each program in NumPy): 32 or 16 rows, chunks of 2
    K tiles, so that the tests see both row tiles and several chunks.
    """
    if device.type != "cuda":
        return MatmulConfig(block_m=32, small_block_m=16, block_n=16, block_k=16, chunk_k=32,
                            num_warps=4, small_num_warps=4, num_stages=1)
    if dtype.itemsize > 2:
        return MatmulConfig(block_m=64, small_block_m=64, block_n=64, block_k=32, chunk_k=512,
                            num_warps=4, small_num_warps=4, num_stages=3)
    return MatmulConfig(block_m=128, small_block_m=64, block_n=128, block_k=64, chunk_k=512,
                        num_warps=8, small_num_warps=4, num_stages=3)


@lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _target_programs(device: torch.device) -> int:
    """Programs a launch should have to fill the device: its SMs (the interpreter: 4)."""
    if device.type != "cuda":
        return 4
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


# Tiles of a "split" launch at most: the size of each device's counter buffer (64 KiB). The
# engine's plans stay far under it; a forced split of the vocabulary's matmul (lm_head,
# 151,936 columns) at 128 rows takes ~6,000 tiles.
MAX_SPLIT_TILES = 16384
_counters: dict[torch.device, torch.Tensor] = {}


def _tile_counters(device: torch.device) -> torch.Tensor:
    """The device's [MAX_SPLIT_TILES] int32 counters, zero between launches (each split
    launch's last programs zero theirs again). Made once, on the first split launch (the
    warm-up before any CUDA graph is captured)."""
    counters = _counters.get(device)
    if counters is None:
        counters = _counters[device] = torch.zeros(MAX_SPLIT_TILES, dtype=torch.int32,
                                                   device=device)
    return counters


def matmul_plan(m: int, n: int, k: int, cfg: MatmulConfig, target_programs: int
                ) -> tuple[str, int]:
    """(plan, row tile) for x [m, k] @ W[n, k]^T: the first of "tiles" with block_m rows,
    "tiles" with small_block_m rows, that launches target_programs programs or more; else
    "split" with small_block_m rows when K has several chunks (the most programs: decode),
    else "tiles" with small_block_m. Every choice gives the same bits."""
    tiles_n = triton.cdiv(n, cfg.block_n)
    for block_m in (cfg.block_m, cfg.small_block_m):
        if triton.cdiv(m, block_m) * tiles_n >= target_programs:
            return "tiles", block_m
    small_tiles = triton.cdiv(m, cfg.small_block_m) * tiles_n
    if k > cfg.chunk_k and small_tiles <= MAX_SPLIT_TILES:
        return "split", cfg.small_block_m
    return "tiles", cfg.small_block_m


def invariant_matmul_triton(x: torch.Tensor, weight: torch.Tensor,
                            bias: torch.Tensor | None = None, *,
                            config: MatmulConfig | None = None,
                            plan: tuple[str, int] | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias [N]) -> [M, N] in x's dtype (contract in
    kernels/__init__.py, matmul_batch_invariant). `config` and `plan` ("tiles" or "split",
    and the row tile) override the choice by shape (tests and benchmarks: every plan gives
    the same bits)."""
    if x.dim() != 2 or weight.dim() != 2 or x.size(1) != weight.size(1):
        raise ValueError(f"matmul_batch_invariant: x {tuple(x.shape)} and weight "
                         f"{tuple(weight.shape)} must be [M, K] and [N, K]")
    if x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError("matmul_batch_invariant: x and weight need a contiguous last axis")
    if bias is not None and bias.shape != (weight.size(0),):
        raise ValueError(f"matmul_batch_invariant: bias {tuple(bias.shape)} must be "
                         f"[{weight.size(0)}]")
    (m, k), n = x.shape, weight.size(0)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    cfg = config or matmul_config(x.device, x.dtype)
    name, block_m = plan or matmul_plan(m, n, k, cfg, _target_programs(x.device))
    if name not in ("tiles", "split") or block_m not in (cfg.block_m, cfg.small_block_m):
        raise ValueError(f"invariant_matmul_triton: plan {plan!r}; expected ('tiles' or "
                         f"'split', {cfg.block_m} or {cfg.small_block_m})")
    grid_m, grid_n = triton.cdiv(m, block_m), triton.cdiv(n, cfg.block_n)
    split = name == "split"
    if split:
        if grid_m * grid_n > MAX_SPLIT_TILES:
            raise ValueError(f"invariant_matmul_triton: a split over {grid_m * grid_n} tiles; "
                             f"at most {MAX_SPLIT_TILES}")
        chunks = triton.cdiv(k, cfg.chunk_k)
        parts = torch.empty((chunks, m, n), dtype=torch.float32, device=x.device)
        counters = _tile_counters(x.device)
        grid: tuple[int, ...] = (grid_m, grid_n, chunks)
    else:
        parts, counters, grid = out, out, (grid_m, grid_n)  # never read without SPLIT
    small = block_m == cfg.small_block_m and block_m != cfg.block_m
    _invariant_matmul_kernel[grid](
        x, weight, bias if bias is not None else weight, out, parts, counters, m, n, k,
        x.stride(0), weight.stride(0),
        HAS_BIAS=bias is not None, SPLIT=split,
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, CHUNK_K=cfg.chunk_k,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=cfg.small_num_warps if small else cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out
