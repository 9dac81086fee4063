"""The dispatch of the fused kernels: one launch where a plain forward runs two, on a GPU.
Only layers/fused.py (a model built on a GPU) and layers/fused_moe.py (the experts of a
mixture-of-experts layer) call them; a plain forward runs the kernels of kernels/__init__.py.

    norm_rope_store_kvcache  norm_rope, then the rotated k and v into the paged cache
                             (reference: norm_rope, then store_kvcache_ref)

two fused forms of skinny_gemm that apply the op before the matmul to x as the matmul loads
it: one launch instead of two, for batch-1 decode, which is launch-bound (same kernel, a
constexpr prologue; references in fused_reference.py: the two references one after the other):

    rms_norm_skinny_gemm     (residual add +) RMSNorm, then x W^T  (qkv_proj, gate_up_proj)
    silu_and_mul_skinny_gemm silu(gate) * up, then x W^T           (down_proj)

and the experts of a mixture-of-experts layer (reference in fused_reference.py):

    fused_moe                each token through its top-k experts' gated MLPs, weighted and
                             summed: two grouped matmuls over all experts
                             (kernels/fused_moe_kernel.py)

Each runs its Triton kernel where kernels.use_triton says so (MYVLLM_FORCE_TRITON included),
otherwise its reference.
"""

from __future__ import annotations

from typing import overload

import torch

from . import norm_rope, use_triton
from .fused_reference import fused_moe_ref, rms_norm_skinny_gemm_ref, silu_and_mul_skinny_gemm_ref
from .reference import store_kvcache_ref

__all__ = [
    "fused_moe",
    "norm_rope_store_kvcache",
    "rms_norm_skinny_gemm",
    "silu_and_mul_skinny_gemm",
]


def norm_rope_store_kvcache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """norm_rope(q, k, ...) -> (q_out, k_out), and store_kvcache(k_out, v, k_cache, v_cache,
    slot_mapping, k_scale, v_scale) (v [N, Hkv, D]; slot -1 = padding, not written). On the
    GPU one kernel launch does both: layers/fused.py uses it where the attention layer would
    store right after RoPE."""
    if use_triton(q):
        from . import layer_ops_triton as triton_impl

        return triton_impl.norm_rope_store_kvcache_triton(
            q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping,
            q_norm_weight, k_norm_weight, eps, k_scale, v_scale)  # fmt: skip
    q_out, k_out = norm_rope(q, k, positions, cos_sin_cache, q_norm_weight, k_norm_weight, eps)
    store_kvcache_ref(k_out, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return q_out, k_out


# rms_norm_skinny_gemm returns one tensor, or (out, residual stream) when given a residual;
# the overloads tell the type checker which.
@overload
def rms_norm_skinny_gemm(x: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                         weight: torch.Tensor, residual: None = None,
                         residual_out: None = None) -> torch.Tensor: ...
@overload
def rms_norm_skinny_gemm(
    x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
    residual: torch.Tensor, residual_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]: ...
def rms_norm_skinny_gemm(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    residual: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """rms_norm(x, norm_weight, eps, residual) @ weight [N, K]^T for x [M, K], 1 <= M <= 8, in
    one launch on the GPU. Without residual -> [M, N]; with it -> ([M, N], x + residual), the
    sum written into residual_out when given (layers/fused.py hands out that tensor before the
    kernel runs)."""
    if use_triton(x):
        from . import skinny_gemm_kernel as triton_impl

        return triton_impl.rms_norm_skinny_gemm_triton(x, norm_weight, eps, weight, residual,
                                                       residual_out=residual_out)
    if residual is None:
        return rms_norm_skinny_gemm_ref(x, norm_weight, eps, weight)
    out, new_residual = rms_norm_skinny_gemm_ref(x, norm_weight, eps, weight, residual)
    return out, new_residual if residual_out is None else residual_out.copy_(new_residual)


def silu_and_mul_skinny_gemm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """silu_and_mul(x) @ weight [N, K]^T for x [M, 2K] = gate | up, 1 <= M <= 8, in one launch
    on the GPU -> [M, N]."""
    if use_triton(x):
        from . import skinny_gemm_kernel as triton_impl

        return triton_impl.silu_and_mul_skinny_gemm_triton(x, weight)
    return silu_and_mul_skinny_gemm_ref(x, weight)


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """The experts of a MoE layer -> [M, H]: x [M, H] through experts topk_ids [M, k] of w13
    [E, 2I, H] (gate | up) and w2 [E, H, I], weighted by topk_weights [M, k] and summed."""
    if use_triton(x):
        from . import fused_moe_kernel as triton_impl

        return triton_impl.fused_moe_triton(x, w13, w2, topk_weights, topk_ids)
    return fused_moe_ref(x, w13, w2, topk_weights, topk_ids)
