"""Which kernel computes a linear layer's matmul, and how the row-parallel layers sum their
ranks' partial outputs, for each device and batch (layers/linear.py and the LM head call
these); the LM head's rows at a prefill, padded on a GPU to a row count cuBLAS already met.
Same math everywhere; the choices are for speed, except batch-invariant mode's
(kernels/batch_invariant.py), which are for bits that do not depend on the batch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from myvllm.kernels import (is_batch_invariant, matmul_batch_invariant, prefers_skinny_gemm,
                            skinny_gemm)
from myvllm.layers.fused import DeferredInput
from myvllm.utils.distributed import all_reduce

CPU_WXT_MAX_ROWS = 256


def linear(x: torch.Tensor | DeferredInput, weight: torch.Tensor,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T + b, the matmul of every linear layer and the LM head.

    A DeferredInput: the op before, left to this matmul's kernel (layers/fused.py; only where
    there is no bias: LinearBase.fuses).
    GPU: F.linear, or for a decode batch of a few rows kernels.skinny_gemm, which streams
    weights that cuBLAS reads at a third of the memory bandwidth or less (where it measured
    faster: kernels.prefers_skinny_gemm). CPU, 2..256 rows: W x^T, which MKL streams 2-3x
    faster than x W^T for the row-major [out, in] weight (decode on a CPU is bound by reading
    the weights; from ~512 rows F.linear wins again). Same math, another summation order.
    Batch-invariant mode (kernels/batch_invariant.py): kernels.matmul_batch_invariant for
    every row count, so that no choice above depends on the batch.
    """
    if isinstance(x, DeferredInput):
        return x.matmul(weight)
    if is_batch_invariant():
        rows = x.reshape(-1, x.size(-1))
        return matmul_batch_invariant(rows.contiguous(), weight, bias).view(
            *x.shape[:-1], weight.size(0))
    if x.is_cuda:
        if uses_skinny_gemm(x, weight, bias):
            return skinny_gemm(x, weight)
        return F.linear(x, weight, bias)
    if x.dim() != 2 or not 2 <= x.size(0) <= CPU_WXT_MAX_ROWS:
        return F.linear(x, weight, bias)
    y = torch.mm(weight, x.t()).t()
    if bias is not None:
        y = y + bias
    return y.contiguous()


def uses_skinny_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether linear(x, weight, bias) runs kernels.skinny_gemm (LinearBase.fuses asks too).
    Never in batch-invariant mode: the skinny kernel's tiling is for 1-8 rows only."""
    return (x.is_cuda and not is_batch_invariant() and x.dim() == 2 and bias is None
            and prefers_skinny_gemm(x.size(0), *weight.shape))


def reduce_partial_sums(y: torch.Tensor, tp_size: int) -> torch.Tensor:
    """Sum the ranks' partial outputs of a row-parallel matmul (in place).

    Batch-invariant mode: NCCL picks its all-reduce algorithm and protocol (ring, tree;
    how the sum is chunked) by message size, that is by the batch, and with them the
    order of the sum. So the partials are gathered (a copy, exact) and added here in rank
    order, the same order for every row at every batch size."""
    if tp_size == 1:
        return y
    if not is_batch_invariant():
        return all_reduce(y)
    parts = [torch.empty_like(y) for _ in range(tp_size)]
    dist.all_gather(parts, y)
    total = parts[0]
    for part in parts[1:]:
        total += part  # rank 0 + rank 1 + ... elementwise: one order whatever the shape
    return y.copy_(total)


def last_token_rows(cu_seqlens_q: torch.Tensor, pad: bool) -> torch.Tensor:
    """The row of each sequence's last new token; with pad (a GPU), followed by copies of row 0
    up to a power of two: row counts the decode graphs' LM head already ran, so cuBLAS picks no
    new kernel (From correct to fast, "Warm-up"). The caller cuts the extra rows' logits."""
    rows = cu_seqlens_q[1:] - 1
    num_rows = rows.numel()
    if not pad or num_rows == 0:
        return rows
    padded = 1 << (num_rows - 1).bit_length()
    return torch.cat([rows, rows.new_zeros(padded - num_rows)])
