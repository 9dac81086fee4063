"""Plain-PyTorch versions of the GPU's matmul kernels beyond the three layer ops.

    skinny_gemm                x W^T for a decode batch of a few rows (skinny_gemm_kernel.py)
    rms_norm_skinny_gemm       rms_norm, then x W^T       layer norms -> qkv_proj, gate_up_proj
    silu_and_mul_skinny_gemm   silu_and_mul, then x W^T   act_fn -> down_proj
    matmul_batch_invariant     batch-invariant mode's matmul (kernels/batch_invariant.py)
    fused_moe                  each token through its top-k experts' gated MLPs, weighted,
                               summed (kernels/fused_moe_kernel.py on the GPU)

The fused forms are simply the two references one after the other. A CPU runs none of them
on the path of Steps 1-6 (only in batch-invariant mode, or for a MoE model); they are the
oracles their kernels are tested against.
"""

from __future__ import annotations

from typing import overload

import torch
import torch.nn.functional as F

from .reference import rms_norm_ref, silu_and_mul_ref


def skinny_gemm_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T -> [M, N]: float32 products and sums, rounded once."""
    return (x.float() @ weight.float().t()).to(x.dtype)


# Rows a CPU matmul is padded to a multiple of, in batch-invariant mode (see below).
INVARIANT_CPU_ROW_MULTIPLE = 8


def matmul_batch_invariant_ref(x: torch.Tensor, weight: torch.Tensor,
                               bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias) -> [M, N], as F.linear, on x padded with zero
    rows to a multiple of INVARIANT_CPU_ROW_MULTIPLE rows.

    Why the padding: the CPU's BLAS is batch-variant too. Measured on the 2-core AMD EPYC
    machines we develop on (torch's MKL/oneDNN sgemm, float32): a row of F.linear gives other
    bits at 1 row (a matrix-vector kernel), at 2-3 rows, at 4 or more, and again at 11 rows
    (an odd tail of the row blocking); padded to a multiple of 4 or 8 rows every row was the
    same at every M from 1 to 700 and every place in the batch (bf16 was invariant unpadded).
    That is a property of one BLAS on one CPU, measured, not designed, and
    tests/kernels/test_batch_invariant.py checks it where the tests run.
    """
    rows = x.size(0)
    padded = -(-rows // INVARIANT_CPU_ROW_MULTIPLE) * INVARIANT_CPU_ROW_MULTIPLE
    if padded != rows:
        x = torch.cat([x, x.new_zeros(padded - rows, x.size(1))])
    return F.linear(x, weight, bias)[:rows]


@overload
def rms_norm_skinny_gemm_ref(x: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                             weight: torch.Tensor, residual: None = None) -> torch.Tensor: ...
@overload
def rms_norm_skinny_gemm_ref(
    x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
    residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...
def rms_norm_skinny_gemm_ref(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """rms_norm_ref then skinny_gemm_ref: x [M, K] -> [M, N]; with residual, that and the new
    residual stream x + residual, as rms_norm_ref returns it."""
    if residual is None:
        return skinny_gemm_ref(rms_norm_ref(x, norm_weight, eps), weight)
    normed, new_residual = rms_norm_ref(x, norm_weight, eps, residual)
    return skinny_gemm_ref(normed, weight), new_residual


def silu_and_mul_skinny_gemm_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """silu_and_mul_ref then skinny_gemm_ref: x [M, 2K] = gate | up, weight [N, K] -> [M, N]."""
    return skinny_gemm_ref(silu_and_mul_ref(x), weight)


def fused_moe_ref(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """The experts of a MoE layer, one expert at a time -> [M, H].

    x [M, H]; w13 [E, 2I, H] (each expert's gate_proj rows, then its up_proj rows); w2 [E, H, I]
    (down_proj); topk_ids [M, k] the experts each token goes to, topk_weights [M, k] float32
    their weights. Token t's output: sum over j of topk_weights[t, j] * expert_j(x[t]), where
    expert_e(x) = down_e(silu(gate_e(x)) * up_e(x)), each matmul rounded to x's dtype as
    transformers' per-expert loop rounds it. Each weighted output is rounded to x's dtype (the
    kernel keeps them in that dtype until they are summed), the k of a token summed in float32
    and rounded once.
    """
    wide = torch.promote_types(x.dtype, torch.float32)  # float64 stays float64 (tests)
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=wide, device=x.device)
    for expert in topk_ids.unique().tolist():
        tokens, slot = torch.where(topk_ids == expert)
        gate_up = (x[tokens].to(wide) @ w13[expert].to(wide).t()).to(x.dtype)  # [n, 2I]
        act = silu_and_mul_ref(gate_up)
        y = (act.to(wide) @ w2[expert].to(wide).t()).to(x.dtype)  # [n, H]
        weighted = (y.to(wide) * topk_weights[tokens, slot, None].to(wide)).to(x.dtype)
        out.index_add_(0, tokens, weighted.to(wide))
    return out.to(x.dtype)
