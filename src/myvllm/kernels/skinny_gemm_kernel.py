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

Fused prologues. At batch 1 a decode step is launch-bound (a few hundred kernels of a few
microseconds; kernels/pdl.py counts them), and the op before each matmul is a whole kernel
that reads and writes only M rows. Since every program reads all of x anyway, it can apply
that op to x as it loads it, and the op's kernel disappears (PROLOGUE, a constexpr; the same
rounding steps as kernels/layer_ops_triton.py):

    PROLOGUE        applied to x, then x W^T           replaces the kernel of
    "rms_norm"      (x + residual) -> RMSNorm          input_layernorm (before qkv_proj),
                                                       post_attention_layernorm (gate_up_proj)
    "silu_and_mul"  x = gate | up -> silu(gate) * up   act_fn (before down_proj)

RMSNorm needs the row's rstd before the first product, so those programs read x twice:

    pass 1: s = round(x + residual), sum(s^2) over the whole row -> rstd  (program 0 also
            stores s: the new residual stream, in a NEW tensor, as other programs still read
            the old one)
    pass 2: the K loop above, on round(round(s * rstd) * norm_weight)

Each program recomputes the prologue for its own use: x is a few KB and stays in cache, so
this costs cache reads and a few FLOPs per weight row streamed, not a launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_args, pdl_wait

# Largest row count the kernel accepts; kernels.prefers_skinny_gemm decides when it is used.
MAX_ROWS = 8


@triton.jit
def _rms_norm_input(x_ptrs, r_ptrs, mask, out_ptr, HAS_RESIDUAL: tl.constexpr):
    """A tile of x, or of the residual stream round(x + residual), in float32."""
    s = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(r_ptrs, mask=mask, other=0.0).to(tl.float32)
        s = (s + r).to(out_ptr.dtype.element_ty).to(tl.float32)
    return s


@triton.jit
def _skinny_gemm_kernel(
    x_ptr,  # [M, K] ("silu_and_mul": [M, 2K] = gate | up), contiguous last axis
    w_ptr,  # [N, K], contiguous K
    out_ptr,  # [M, N] contiguous
    residual_ptr,  # "rms_norm" with HAS_RESIDUAL: [M, K], contiguous K
    norm_weight_ptr,  # "rms_norm": [K]
    residual_out_ptr,  # "rms_norm" with HAS_RESIDUAL: [M, K] contiguous, written by program 0
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_rm,
    eps,
    BLOCK_M: tl.constexpr,  # M rounded up to a power of two
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PROLOGUE: tl.constexpr,  # "none" | "rms_norm" | "silu_and_mul", applied to x as loaded
    HAS_RESIDUAL: tl.constexpr,
    USE_PDL: tl.constexpr,  # kernels/pdl.py
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    m_mask = offs_m < M
    dtype = out_ptr.dtype.element_ty
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    # The first tile of W is loaded before pdl_wait: no kernel writes the weights, so with
    # PDL this read overlaps the end of the previous kernel. Each iteration below loads the
    # next tile before it uses the current one.
    w = tl.load(w_ptrs, mask=n_mask[:, None] & (offs_k < K)[None, :], other=0.0)
    pdl_wait(USE_PDL)
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    r_ptrs = residual_ptr + offs_m[:, None] * stride_rm + offs_k[None, :]
    if PROLOGUE == "rms_norm":  # pass 1: rstd of each row (and the new residual stream)
        sum_sq = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            mask = m_mask[:, None] & ((k0 + offs_k) < K)[None, :]
            s = _rms_norm_input(x_ptrs + k0, r_ptrs + k0, mask, out_ptr, HAS_RESIDUAL)
            if HAS_RESIDUAL:
                if tl.program_id(0) == 0:
                    res_ptrs = residual_out_ptr + offs_m[:, None] * K + k0 + offs_k[None, :]
                    tl.store(res_ptrs, s.to(dtype), mask=mask)
            sum_sq += s * s
        rstd = tl.math.rsqrt(tl.sum(sum_sq, axis=1) / K + eps)
    acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = (k0 + offs_k) < K
        x_mask = m_mask[:, None] & k_mask[None, :]
        w_ptrs += BLOCK_K  # the next tile (past the end of K: all masked, no memory traffic)
        w_next = tl.load(w_ptrs, mask=n_mask[:, None] & (k0 + BLOCK_K + offs_k < K)[None, :],
                         other=0.0)
        if PROLOGUE == "rms_norm":  # round where rms_norm_ref rounds: after the norm, after w
            x = _rms_norm_input(x_ptrs, r_ptrs, x_mask, out_ptr, HAS_RESIDUAL)
            norm_w = tl.load(norm_weight_ptr + k0 + offs_k, mask=k_mask, other=0.0)
            x = (x * rstd[:, None]).to(dtype).to(tl.float32)
            x = (x * norm_w.to(tl.float32)[None, :]).to(dtype).to(tl.float32)
        elif PROLOGUE == "silu_and_mul":  # F.silu rounds to the model dtype before the multiply
            gate = tl.load(x_ptrs, mask=x_mask, other=0.0).to(tl.float32)
            up = tl.load(x_ptrs + K, mask=x_mask, other=0.0).to(tl.float32)
            act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
            x = (act * up).to(dtype).to(tl.float32)
        else:
            x = tl.load(x_ptrs, mask=x_mask, other=0.0).to(tl.float32)
        acc += x[:, None, :] * w.to(tl.float32)[None, :, :]
        w = w_next
        x_ptrs += BLOCK_K
        r_ptrs += BLOCK_K
    y = tl.sum(acc, axis=2)  # [BLOCK_M, BLOCK_N]
    out_ptrs = out_ptr + offs_m[:, None] * N + offs_n[None, :]
    tl.store(out_ptrs, y.to(dtype), mask=m_mask[:, None] & n_mask[None, :])


def skinny_gemm_config(num_rows: int, n: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps), from a sweep on the H200 over the layers of
    Qwen3-0.6B, Qwen3-8B (one rank and two) and Qwen3-30B-A3B, each with its prologue
    (docs/diagnostics/skinny_gemm_sweep.py; docs/benchmarks.md). Few output features
    (N <= 2048) -> 4 per program and long K tiles, so that enough programs share the
    reading; many -> 8 per program, 2 warps. The [rows, BLOCK_N, BLOCK_K] float32
    accumulator is spread over the warps' threads and must stay in registers: at 128 or
    more values a thread (8 x 1024 on 2 warps) it spilled and ran 3x slower at one row and
    30x at two, on 8B's 4,096-wide rows."""
    if num_rows == 1:
        block_n, block_k, num_warps = (4, 1024, 4) if n <= 2048 else (
            (4, 512, 4) if n <= 4096 else (8, 512, 2))
    elif num_rows == 2 and n <= 1024:
        block_n, block_k, num_warps = 4, 1024, 4
    else:
        block_n, block_k, num_warps = 4, 512 if num_rows <= 4 else 256, 4
    return block_n, min(block_k, triton.next_power_of_2(k)), num_warps


def _check(name: str, x: torch.Tensor, weight: torch.Tensor, gate_up: bool = False) -> None:
    """x [M, K] (gate_up: [M, 2K] = gate | up) and weight [N, K], 1 <= M <= MAX_ROWS,
    contiguous last axes."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != (2 if gate_up else 1) * weight.shape[1]:
        raise ValueError(f"{name}: x {tuple(x.shape)} and weight {tuple(weight.shape)} must be "
                         f"{'[M, 2K] (gate | up)' if gate_up else '[M, K]'} and [N, K]")
    if not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"{name}: {x.shape[0]} rows; it handles 1..{MAX_ROWS}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"{name}: x and weight need a contiguous last axis")


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    config: tuple[int, int, int] | None,
    prologue: str = "none",
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    residual: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """-> (out [M, N], the new residual stream [M, K] or None: written into residual_out when
    given). Arguments already checked."""
    num_rows, (n, k) = x.shape[0], weight.shape
    out = torch.empty((num_rows, n), dtype=x.dtype, device=x.device)
    new_residual = None if residual is None else (
        out.new_empty((num_rows, k)) if residual_out is None else residual_out)
    block_n, block_k, num_warps = config or skinny_gemm_config(num_rows, n, k)
    _skinny_gemm_kernel[(triton.cdiv(n, block_n),)](
        x, weight, out,
        x if residual is None else residual,  # (unused pointers get any tensor)
        x if norm_weight is None else norm_weight,
        out if new_residual is None else new_residual,
        num_rows, n, k, x.stride(0), weight.stride(0),
        0 if residual is None else residual.stride(0), eps,
        BLOCK_M=triton.next_power_of_2(num_rows), BLOCK_N=block_n, BLOCK_K=block_k,
        PROLOGUE=prologue, HAS_RESIDUAL=residual is not None, num_warps=num_warps,
        **pdl_args(x),
    )  # fmt: skip
    return out, new_residual


def skinny_gemm_triton(x: torch.Tensor, weight: torch.Tensor,
                       config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T -> [M, N] in x's dtype, for 1 <= M <= MAX_ROWS.

    `config` overrides (BLOCK_N, BLOCK_K, num_warps) (tests and tuning sweeps).
    """
    _check("skinny_gemm", x, weight)
    return _launch(x, weight, config)[0]


def rms_norm_skinny_gemm_triton(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    residual: torch.Tensor | None = None,
    config: tuple[int, int, int] | None = None,
    residual_out: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """rms_norm(x, norm_weight, eps, residual) @ weight^T in one launch: x [M, K] -> [M, N];
    with residual [M, K], (that, x + residual) like rms_norm, the sum written into
    residual_out when given (a new contiguous [M, K] tensor). 1 <= M <= MAX_ROWS."""
    _check("rms_norm_skinny_gemm", x, weight)
    if norm_weight.shape != (x.shape[1],) or norm_weight.stride(0) != 1:
        raise ValueError(f"rms_norm_skinny_gemm: norm_weight {tuple(norm_weight.shape)} must be "
                         f"contiguous [{x.shape[1]}]")
    if residual is not None and (residual.shape != x.shape or residual.stride(1) != 1):
        raise ValueError(f"rms_norm_skinny_gemm: residual {tuple(residual.shape)} must match x "
                         f"{tuple(x.shape)} with a contiguous last axis")
    if residual_out is not None and (residual_out.shape != x.shape
                                     or not residual_out.is_contiguous()):  # fmt: skip
        raise ValueError(f"rms_norm_skinny_gemm: residual_out {tuple(residual_out.shape)} must "
                         f"be a contiguous {tuple(x.shape)}")
    out, new_residual = _launch(x, weight, config, "rms_norm", norm_weight, eps, residual,
                                residual_out)  # fmt: skip
    return out if new_residual is None else (out, new_residual)


def silu_and_mul_skinny_gemm_triton(x: torch.Tensor, weight: torch.Tensor,
                                    config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """silu_and_mul(x) @ weight^T in one launch: x [M, 2K] = gate | up, weight [N, K] -> [M, N],
    for 1 <= M <= MAX_ROWS."""
    _check("silu_and_mul_skinny_gemm", x, weight, gate_up=True)
    return _launch(x, weight, config, "silu_and_mul")[0]
