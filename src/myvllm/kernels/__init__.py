"""Every kernel of the engine, each as Triton (GPU) and as plain PyTorch (CPU, test oracle).

The three attention kernels (references in reference.py):

    store_kvcache            write this step's K/V into the paged cache
    flash_attention_varlen   prefill: causal attention over variable-length sequences,
                             K/V contiguous, or read from the paged cache (cached prefix)
    paged_attention_decode   decode: one query token per sequence against its paged K/V

and three small per-token ops of a decoder layer, fused into one kernel each on the GPU
(references in reference.py too):

    rms_norm                 (residual add +) RMSNorm
    norm_rope                (per-head RMSNorm +) rotary embedding of q and k
    silu_and_mul             silu(gate) * up

and the matmul of every linear layer and the LM head, which picks its kernel by device and
batch (no reference: it is the choice, each choice computes x W^T + b):

    linear                   F.linear; on a GPU skinny_gemm for a few rows; on a CPU W x^T
                             for 2..256 rows; in batch-invariant mode matmul_batch_invariant

with the two matmuls it may choose besides F.linear (dispatch in kernels/linear_kernels.py,
references in fused_reference.py):

    skinny_gemm              x W^T for x of 1..8 rows (on a GPU where prefers_skinny_gemm
                             says it beats cuBLAS)
    matmul_batch_invariant   x W^T (+ b) summed over K in fixed 512-element chunks in a
                             fixed order at every row count, so a row's bits never depend
                             on its batch
                             (kernels/invariant_matmul_kernel.py, kernels/batch_invariant.py)

The fused kernels of a GPU (norm_rope_store_kvcache, the skinny_gemm with an RMSNorm or
SiLU-and-mul prologue) and the experts of a mixture-of-experts layer (fused_moe) have their
dispatch in kernels/fused_ops.py.

Dispatch: the public functions below (linear aside: it chooses by device and shape) run the
Triton kernel when the tensors are on CUDA (and Triton is installed), otherwise the PyTorch
reference (kernels/triton_dispatch.py chooses; kernels/triton_calls.py calls the Triton side).
The environment variable MYVLLM_FORCE_TRITON overrides that choice at call time:

    MYVLLM_FORCE_TRITON=1   always Triton (on CPU tensors that needs TRITON_INTERPRET=1,
                            set before the kernel modules are imported: the tests do this)
    MYVLLM_FORCE_TRITON=0   always the PyTorch reference (debugging on the GPU)

Triton is imported lazily, on first use, so a machine without Triton runs the references.

Batch-invariant mode (set_batch_invariant; kernels/batch_invariant.py says why): the
attention kernels' Triton path then reduces every row in one fixed order, a decode row
through the prefill kernel, and linear runs matmul_batch_invariant; the references are
unchanged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, overload

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from .tile_map import TileMap

from . import batch_invariant, triton_calls
from .batch_invariant import is_batch_invariant, set_batch_invariant
from .fused_reference import matmul_batch_invariant_ref, skinny_gemm_ref
from .linear_kernels import (linear_by_kernel, matmul_batch_invariant, prefers_skinny_gemm,
                             skinny_gemm, uses_skinny_gemm)
from .reference import (
    flash_attention_varlen_ref,
    norm_rope_ref,
    paged_attention_decode_ref,
    rms_norm_ref,
    silu_and_mul_ref,
    store_kvcache_ref,
)
from .triton_dispatch import triton_available, use_triton

__all__ = [
    "flash_attention_varlen",
    "flash_attention_varlen_ref",
    "is_batch_invariant",
    "linear",
    "matmul_batch_invariant",
    "matmul_batch_invariant_ref",
    "norm_rope",
    "norm_rope_ref",
    "paged_attention_decode",
    "paged_attention_decode_ref",
    "rms_norm",
    "rms_norm_ref",
    "set_batch_invariant",
    "silu_and_mul",
    "silu_and_mul_ref",
    "prefers_skinny_gemm",
    "skinny_gemm",
    "skinny_gemm_ref",
    "store_kvcache",
    "store_kvcache_ref",
    "triton_available",
    "use_triton",
    "uses_skinny_gemm",
]


def store_kvcache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write key/value [N, Hkv, D] into k_cache/v_cache [num_blocks, block_size, Hkv, D] at
    slot_mapping [N] (slot = block_id * block_size + offset; -1 = padding, skipped). In place.
    An fp8 cache stores key / k_scale and value / v_scale (fp8_kv_reference.quantize_kv)."""
    if use_triton(key):
        return triton_calls.store_kvcache(key, value, k_cache, v_cache, slot_mapping,
                                          k_scale, v_scale)
    store_kvcache_ref(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def flash_attention_varlen(
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
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Causal prefill attention -> o [Nq, Hq, D] (written into `out` when given).

    q [Nq, Hq, D]; sequence b's new tokens are rows cu_seqlens_q[b]:cu_seqlens_q[b+1] and
    are the LAST seqlen_q of its seqlen_k context tokens (query i sits at absolute position
    seqlen_k - seqlen_q + i). Without block_tables, k/v [Nk, Hkv, D] hold each whole context
    contiguously (rows cu_seqlens_k[b]:cu_seqlens_k[b+1]). With block_tables [B, max_blocks],
    the context is read from k_cache/v_cache (the new tokens must already be stored there)
    and k/v are not used (an fp8 cache is dequantized with k_scale/v_scale as it is read).
    max_seqlen_q/max_seqlen_k are host ints (no device sync needed).

    tile_map (Triton only; kernels/tile_map.build_tile_map) lists the query tiles to run
    (long ones cut along their keys), so that the launch has the same shape at every step
    (CUDA graphs of chunked steps). Rows of q that no tile covers (padding, or the decode
    rows the caller computes with paged_attention_decode) are left unwritten. The reference
    ignores it.
    """
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale,
            block_tables, k_cache, v_cache)  # fmt: skip
    if use_triton(q):
        return triton_calls.flash_attention_varlen(*args, tile_map, out, k_scale, v_scale)
    o = flash_attention_varlen_ref(*args, k_scale, v_scale)
    return o if out is None else out.copy_(o)


def paged_attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Decode attention -> o [B, Hq, D] for q [B, Hq, D] (one new token per sequence).

    Sequence b attends to its first context_lens[b] cached tokens, found through
    block_tables[b] (-1 padded). CUDA-graph safe on the Triton path: no host syncs, launch
    shape from tensor shapes only. Rows with context_lens 0 return zeros. An fp8 cache is
    dequantized with k_scale/v_scale as it is read.
    """
    if use_triton(q):
        return triton_calls.paged_attention_decode(q, k_cache, v_cache, block_tables,
                                                   context_lens, scale, k_scale, v_scale)
    return paged_attention_decode_ref(q, k_cache, v_cache, block_tables, context_lens, scale,
                                      k_scale, v_scale)


# rms_norm returns one tensor, or (out, residual stream) when given a
# residual; the overloads tell the type checker which.
@overload
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: None = None) -> torch.Tensor: ...
@overload
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...
def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last axis; with residual, (rmsnorm(x + residual), x + residual)."""
    if use_triton(x):
        return triton_calls.rms_norm(x, weight, eps, residual)
    return rms_norm_ref(x, weight, eps, residual)


def norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [N, Hq, D], k [N, Hk, D] -> RoPE(per-head RMSNorm(x)) of each, contiguous (no norm
    when the weights are None). On the GPU both are one kernel launch.

    cos_sin_cache [max_position, D] float32 (cos | sin); token i rotates by row positions[i].
    """
    if use_triton(q):
        return triton_calls.norm_rope(q, k, positions, cos_sin_cache, q_norm_weight,
                                      k_norm_weight, eps)
    return (norm_rope_ref(q, positions, cos_sin_cache, q_norm_weight, eps),
            norm_rope_ref(k, positions, cos_sin_cache, k_norm_weight, eps))


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] = [gate | up] -> silu(gate) * up [..., I]."""
    if use_triton(x):
        return triton_calls.silu_and_mul(x)
    return silu_and_mul_ref(x)


# On a CPU, the row counts that linear computes as W x^T.
CPU_WXT_MAX_ROWS = 256


def linear(x: torch.Tensor, weight: torch.Tensor,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T + b, the matmul of every linear layer and the LM head.

    GPU: F.linear, or for a decode batch of a few rows skinny_gemm, which streams weights that
    cuBLAS reads at a third of the memory bandwidth or less (where it measured faster:
    prefers_skinny_gemm). CPU, 2..256 rows: W x^T, which MKL streams 2-3x faster than x W^T
    for the row-major [out, in] weight (decode on a CPU is bound by reading the weights; from
    ~512 rows F.linear wins again). Same math, another summation order.
    Batch-invariant mode (kernels/batch_invariant.py): matmul_batch_invariant for every row
    count, so that no choice above depends on the batch.
    """
    if batch_invariant.enabled or x.is_cuda:
        return linear_by_kernel(x, weight, bias)  # kernels/linear_kernels.py
    if x.dim() != 2 or not 2 <= x.size(0) <= CPU_WXT_MAX_ROWS:
        return F.linear(x, weight, bias)
    y = torch.mm(weight, x.t()).t()
    if bias is not None:
        y = y + bias
    return y.contiguous()
