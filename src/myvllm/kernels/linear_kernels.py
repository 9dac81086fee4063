"""The matmuls that kernels.linear may choose besides F.linear: skinny_gemm for a GPU's decode
batch of a few rows (where prefers_skinny_gemm says it beats cuBLAS) and
matmul_batch_invariant in batch-invariant mode (references in kernels/fused_reference.py);
and the padding of a GPU prefill's LM-head rows to a row count cuBLAS has met already.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import batch_invariant
from .fused_reference import matmul_batch_invariant_ref, skinny_gemm_ref
from .triton_dispatch import use_triton


def linear_by_kernel(x: torch.Tensor, weight: torch.Tensor,
                     bias: torch.Tensor | None) -> torch.Tensor:
    """kernels.linear in batch-invariant mode (matmul_batch_invariant for every row count) or
    on CUDA tensors: skinny_gemm where uses_skinny_gemm says so, else F.linear (cuBLAS)."""
    if batch_invariant.enabled:
        rows = x.reshape(-1, x.size(-1))
        return matmul_batch_invariant(rows.contiguous(), weight, bias).view(
            *x.shape[:-1], weight.size(0))
    if uses_skinny_gemm(x, weight, bias):
        return skinny_gemm(x, weight)
    return F.linear(x, weight, bias)


def uses_skinny_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether linear(x, weight, bias) runs skinny_gemm (a fused linear layer asks too:
    layers/fused.py). Never in batch-invariant mode: the skinny kernel's tiling is for 1-8
    rows only."""
    return (x.is_cuda and not batch_invariant.enabled and x.dim() == 2 and bias is None
            and prefers_skinny_gemm(x.size(0), *weight.shape))


def prefers_skinny_gemm(num_rows: int, out_features: int, in_features: int) -> bool:
    """Whether skinny_gemm beats cuBLAS for x [num_rows, in] @ W[out, in]^T on a GPU.

    Measured on the H200 (bf16, inside CUDA graphs, weights read from memory, not L2;
    docs/benchmarks.md). At 1 row: every layer of Qwen3-0.6B (1.0-4.9x); on Qwen3-8B's and
    Qwen3-30B-A3B's o_proj and down_proj up to 1.4x, while their qkv_proj and gate_up_proj
    are up to 16% behind cuBLAS alone (kept: they take the RMSNorm kernel, its launch and its
    round trip through memory with them; not measured against that pair); never the LM head
    (151,936 outputs). At 2 rows only small matrices with outputs <= inputs
    (0.6B's o_proj 3.9x, down_proj 1.3x; at 8B's 4,096 outputs cuBLAS is ahead); at 3-4 rows
    only 0.6B's o_proj (1.9x); at 8 rows never.
    """
    if num_rows == 1:
        return out_features <= 8 * in_features
    if num_rows == 2:
        return out_features <= min(in_features, 2048)
    return num_rows <= 4 and out_features <= 1024 and in_features <= 2048


def matmul_batch_invariant(x: torch.Tensor, weight: torch.Tensor,
                           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias [N]) -> [M, N], each row's bits independent of M
    and of the row's place among them (kernels/invariant_matmul_kernel.py; on a CPU the
    reference, whose invariance is measured, not designed: see matmul_batch_invariant_ref)."""
    if use_triton(x):
        from . import invariant_matmul_kernel as triton_impl

        return triton_impl.invariant_matmul_triton(x, weight, bias)
    return matmul_batch_invariant_ref(x, weight, bias)


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T -> [M, N] for 1 <= M <= 8 (kernels/skinny_gemm_kernel.py)."""
    if use_triton(x):
        from . import skinny_gemm_kernel as triton_impl

        return triton_impl.skinny_gemm_triton(x, weight)
    return skinny_gemm_ref(x, weight)


def pad_rows_to_power_of_two(rows: torch.Tensor) -> torch.Tensor:
    """rows followed by copies of row 0 up to a power of two. On a GPU the LM head of a prefill
    step (one row per sequence) then runs at a row count the decode graphs' LM head already
    ran, so cuBLAS loads no new kernel mid-run (the guide's From correct to fast, "Warm-up");
    the caller cuts the extra rows' logits."""
    num_rows = rows.numel()
    if num_rows == 0:
        return rows
    padded = 1 << (num_rows - 1).bit_length()
    return torch.cat([rows, rows.new_zeros(padded - num_rows)])
