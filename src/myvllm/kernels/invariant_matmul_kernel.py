"""Triton kernel: y = x W^T (+ b) whose every row is the same whatever the row count.

cuBLAS picks its kernel by shape: at a few rows it may split K over several thread blocks
and add their partial sums, at many rows it tiles differently, so one row of x times W gives
bits that depend on how many rows came with it. Here one tiling serves every shape:

    program (pid_m, pid_n) computes y[pid_m*BLOCK_M : +BLOCK_M, pid_n*BLOCK_N : +BLOCK_N]

        acc = 0 (float32)
        for k0 in 0, BLOCK_K, 2*BLOCK_K, ... < K:      the same tiles, in the same order,
            acc += x[rows, k0:k0+BLOCK_K] @ W[cols, k0:k0+BLOCK_K]^T     for every M

The sum of one output element runs over the same K tiles in the same order, and one tl.dot
of a tile computes each output element from its own row and column only, so neither the
number of rows nor a row's place in its tile changes its bits. The price: no split-K (a
batch of one row keeps only N / BLOCK_N programs busy) and one tile size for all shapes
(the idea is from Thinking Machines' "Defeating Nondeterminism in LLM Inference", 2025).

M is not specialised by Triton (do_not_specialize): the same compiled kernel runs for 1 row
and for 4,096, so not even the compiler sees the batch size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["M"])
def _invariant_matmul_kernel(
    x_ptr,  # [M, K], contiguous K
    w_ptr,  # [N, K], contiguous K
    bias_ptr,  # [N] when HAS_BIAS
    out_ptr,  # [M, N] contiguous
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
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
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = (k0 + offs_k) < K  # the last tile's columns past K load as 0: adds 0
        x = tl.load(x_ptrs + k0, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs + k0, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@dataclass(frozen=True)
class MatmulConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def matmul_config(device: torch.device, dtype: torch.dtype) -> MatmulConfig:
    """The one tiling per device and dtype (never per shape: that is the point).

    GPU, 16-bit: 128 x 128 output tiles over K tiles of 64, 8 warps (the tile of Triton's
    matmul tutorial and of vLLM's batch-invariant matmul on Hopper). fp32 tiles take twice
    the shared memory, so they are halved. The CPU interpreter gets small tiles: it runs each
    program in NumPy and the tests stay fast.
    """
    if device.type != "cuda":
        return MatmulConfig(block_m=16, block_n=16, block_k=16, num_warps=4, num_stages=1)
    if dtype.itemsize > 2:
        return MatmulConfig(block_m=64, block_n=64, block_k=32, num_warps=4, num_stages=3)
    return MatmulConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3)


def invariant_matmul_triton(x: torch.Tensor, weight: torch.Tensor,
                            bias: torch.Tensor | None = None, *,
                            config: MatmulConfig | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias [N]) -> [M, N] in x's dtype (contract in
    kernels/__init__.py, matmul_batch_invariant)."""
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
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n))
    _invariant_matmul_kernel[grid](
        x, weight, bias if bias is not None else weight, out, m, n, k,
        x.stride(0), weight.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out
