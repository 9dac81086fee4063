"""Triton kernel for y = x W^T with few rows of x: the linear layers of a small decode batch.

Why: at batch 1 a decode step multiplies one row of activations by every weight matrix, so
its time is the time to read the weights (0.9 GB for Qwen3-0.6B's layers). cuBLAS's kernels
for such shapes read them at 0.3-2.6 TB/s on an H200, 1.15 TB/s over a whole decode step
(docs/benchmarks.md), where the memory delivers ~4: few output features (o_proj's 1024)
leave most SMs idle or need a split-K pass. Here each program owns a few
output features (BLOCK_N rows of W) and streams those rows once, for all M rows of x:

    x [M, K]  (M <= 8: tiny, stays in cache)         W [N, K], row-major
    program p: W[p*BLOCK_N : (p+1)*BLOCK_N, :]  --dot with every row of x-->  y[:, p*BLOCK_N:...]

Products accumulate elementwise in float32 over the K loop and are summed once at the end,
so the loop is loads and FMAs only. There is no split over K: that would need atomics (a
run-to-run varying summation order, and CUDA graphs must give the eager path's exact tokens)
or a second kernel. The reference is skinny_gemm_ref: x W^T in float32, rounded once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Largest row count the kernel accepts; kernels.prefers_skinny_gemm decides when it is used.
MAX_ROWS = 8


@triton.jit
def _skinny_gemm_kernel(
    x_ptr,  # [M, K], contiguous K
    w_ptr,  # [N, K], contiguous K
    out_ptr,  # [M, N] contiguous
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    BLOCK_M: tl.constexpr,  # M rounded up to a power of two
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    m_mask = offs_m < M
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = (k0 + offs_k) < K
        w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        acc += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    y = tl.sum(acc, axis=2)  # [BLOCK_M, BLOCK_N]
    out_ptrs = out_ptr + offs_m[:, None] * N + offs_n[None, :]
    tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def skinny_gemm_config(num_rows: int, n: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps), from a sweep on the H200 at Qwen3-0.6B's shapes
    (docs/benchmarks.md). Few output features (o_proj, down_proj: N = 1024) -> 4 per
    program, so that 256 programs share the reading; long rows -> long K tiles. The
    [rows, BLOCK_N, BLOCK_K] float32 accumulator must fit in registers."""
    block_n = 4 if n <= 2048 else 8
    block_k = 1024 if k >= 2048 and num_rows <= 2 else 512 if num_rows <= 4 else 256
    num_warps = 2 if n > 2048 and num_rows <= 2 else 4
    return block_n, min(block_k, triton.next_power_of_2(k)), num_warps


def skinny_gemm_triton(x: torch.Tensor, weight: torch.Tensor,
                       config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T -> [M, N] in x's dtype, for 1 <= M <= MAX_ROWS.

    `config` overrides (BLOCK_N, BLOCK_K, num_warps) (tests and tuning sweeps).
    """
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"skinny_gemm: x {tuple(x.shape)} and weight {tuple(weight.shape)} "
                         "must be [M, K] and [N, K]")
    num_rows, k = x.shape
    n = weight.shape[0]
    if not 1 <= num_rows <= MAX_ROWS:
        raise ValueError(f"skinny_gemm: {num_rows} rows; it handles 1..{MAX_ROWS}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("skinny_gemm: x and weight need a contiguous last axis")
    out = torch.empty((num_rows, n), dtype=x.dtype, device=x.device)
    block_n, block_k, num_warps = config or skinny_gemm_config(num_rows, n, k)
    _skinny_gemm_kernel[(triton.cdiv(n, block_n),)](
        x, weight, out, num_rows, n, k, x.stride(0), weight.stride(0),
        BLOCK_M=triton.next_power_of_2(num_rows), BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=num_warps,
    )  # fmt: skip
    return out
