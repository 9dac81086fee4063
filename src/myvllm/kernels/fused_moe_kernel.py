"""Triton fused-MoE: the experts of a mixture-of-experts layer as two grouped matmuls.

A MoE layer sends each token to its top-k experts (k of E; Qwen3-30B-A3B: 8 of 128), each a
gated MLP of its own. Done one expert at a time (fused_moe_ref) that is E small matmuls per
projection, most of them over a handful of rows, plus a gather and a scatter per expert. Here
each projection is ONE kernel launch over all experts:

1. moe_align_block_size (no host sync; one Triton program for a decode batch, PyTorch ops
   above that): the M*k (token, slot) pairs, sorted by expert, each expert's list padded to a
   multiple of BLOCK_M, so that every block of BLOCK_M rows belongs to a single expert:

       topk_ids [[2, 0], [2, 1], [0, 2]]  (M = 3, k = 2; pair i = token i // k, slot i % k)
       sorted_ids   0: [1, 4, P, P]   1: [3, P, P, P]   2: [0, 2, 5, P]     (BLOCK_M = 4,
       block_expert    0                 1                 2                 P = padding = M*k)

2. w13 kernel: program (block b, column tile n) multiplies the block's rows of x (row = pair
   // k) by its expert's gate and up weights (w13[e] = [gate_proj; up_proj], two accumulators),
   applies silu(gate) * up, and writes row `pair` of the [M*k, I] intermediate.
3. w2 kernel: the same grouping over the intermediate (row = pair), times w2[e] = down_proj,
   times the pair's router weight; row `pair` of [M*k, H].
4. out[t] = the sum of its k rows (PyTorch, float32 accumulation).

Blocks are launched for the largest padded count the shapes allow; the ones past the real
count return at once. So the launch depends on tensor shapes only (CUDA-graph safe), and a
block never mixes experts: each program reads one expert's weight tile, which the programs
of that expert's other blocks (neighbours in launch order) then find in L2.

Rounding follows fused_moe_ref: each matmul rounded to the model dtype, silu rounded before
the multiply, each weighted expert output rounded (it is stored in the model dtype), the k
outputs of a token summed in float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class MoeConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


def moe_config(num_pairs: int, num_experts: int) -> MoeConfig:
    """Tiles from the rows an expert gets on average (pairs = tokens * k). A decode batch
    gives most experts 0-2 rows: the smallest block tl.dot takes (16) wastes least; a
    prefill gives each hundreds, and taller blocks reuse each weight tile for more rows.
    The tiles are a first choice, not yet measured; benchmarks/benchmark_moe.py --sweep times
    others."""
    rows_per_expert = num_pairs / num_experts
    if rows_per_expert <= 4:
        return MoeConfig(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=3)
    if rows_per_expert <= 32:
        return MoeConfig(block_m=32, block_n=64, block_k=64, num_warps=4, num_stages=4)
    return MoeConfig(block_m=64, block_n=128, block_k=64, num_warps=8, num_stages=3)


# Up to this many (token, expert) pairs (a decode batch of 32 tokens at k = 8), the alignment
# is one Triton program (_moe_align_kernel) instead of ~25 small PyTorch kernels: at decode
# each costs a few microseconds, the order of the whole layer's weight read (~18 us on an
# H200 for 8 experts of Qwen3-30B-A3B). 0 turns the kernel off.
ALIGN_KERNEL_MAX_PAIRS = 256


def moe_align_block_size(
    topk_ids: torch.Tensor, block_m: int, num_experts: int, use_kernel: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (sorted_ids [P] int32, block_expert [P / block_m] int32, num_padded [1] int32).

    sorted_ids lists the (token, slot) pairs (index token * k + slot into topk_ids.flatten())
    grouped by expert, in pair order within an expert, each expert's group padded to a multiple
    of block_m with M*k; block b (rows b*block_m ...) belongs to expert block_expert[b];
    num_padded is the padded total, on the device. P, the capacity, is the largest total the
    shapes allow: at most min(E, M*k) experts are hit, each adding at most block_m - 1 rows of
    padding. use_kernel (default: up to ALIGN_KERNEL_MAX_PAIRS pairs) picks _moe_align_kernel
    over the PyTorch ops; both give the same tensors.
    """
    flat = topk_ids.flatten().long()
    num_pairs = flat.numel()
    capacity = triton.cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1),
                           block_m) * block_m  # fmt: skip
    if use_kernel is None:
        use_kernel = num_pairs <= ALIGN_KERNEL_MAX_PAIRS
    if use_kernel:
        sorted_ids = torch.empty(capacity, dtype=torch.int32, device=flat.device)
        block_expert = torch.empty(capacity // block_m, dtype=torch.int32, device=flat.device)
        num_padded = torch.empty(1, dtype=torch.int32, device=flat.device)
        _moe_align_kernel[(1,)](
            flat, sorted_ids, block_expert, num_padded, num_pairs, num_experts, capacity,
            BLOCK_M=block_m, BLOCK_T=triton.next_power_of_2(num_pairs),
            BLOCK_E=triton.next_power_of_2(num_experts),
            BLOCK_B=triton.next_power_of_2(capacity // block_m), BLOCK_C=256, num_warps=8,
        )  # fmt: skip
        return sorted_ids, block_expert, num_padded
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    # The pairs in expert order; pair number j of expert e goes to padded_start[e] + j.
    order = torch.argsort(flat, stable=True)
    expert_of = flat.gather(0, order)
    first_in_order = counts.cumsum(0) - counts
    dest = (padded_end - padded).gather(0, expert_of) + (
        torch.arange(num_pairs, device=flat.device) - first_in_order.gather(0, expert_of))
    sorted_ids = torch.full((capacity,), num_pairs, dtype=torch.int32, device=flat.device)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    block_start = torch.arange(0, capacity, block_m, device=flat.device)
    # Blocks past the padded total get a valid expert id; the kernel skips them anyway.
    block_expert = torch.searchsorted(padded_end, block_start, right=True)
    block_expert = block_expert.clamp_(max=num_experts - 1).to(torch.int32)
    return sorted_ids, block_expert, padded_end[-1:].to(torch.int32)


@triton.jit
def _moe_align_kernel(
    topk_ids_ptr,  # [num_pairs] expert of each (token, slot) pair
    sorted_ids_ptr,  # [capacity] int32 out
    block_expert_ptr,  # [capacity / BLOCK_M] int32 out
    num_padded_ptr,  # [1] int32 out
    num_pairs,
    num_experts,
    capacity,
    BLOCK_M: tl.constexpr,
    BLOCK_T: tl.constexpr,  # >= num_pairs
    BLOCK_E: tl.constexpr,  # >= num_experts
    BLOCK_B: tl.constexpr,  # >= capacity / BLOCK_M
    BLOCK_C: tl.constexpr,
):
    """moe_align_block_size for a few pairs, in one program: a [pairs, experts] one-hot
    matrix gives each expert's count (sum over pairs) and each pair's rank among its expert's
    pairs (cumulative sum down the pairs)."""
    offs_t = tl.arange(0, BLOCK_T)
    offs_e = tl.arange(0, BLOCK_E)
    t_mask = offs_t < num_pairs
    ids = tl.load(topk_ids_ptr + offs_t, mask=t_mask, other=-1)  # -1: no expert
    onehot = (ids[:, None] == offs_e[None, :]).to(tl.int32)  # [T, E]
    counts = tl.sum(onehot, axis=0)
    rank = tl.sum((tl.cumsum(onehot, axis=0) - 1) * onehot, axis=1)  # [T]
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, axis=0)
    start = tl.sum((padded_end - padded)[None, :] * onehot, axis=1)  # [T]: its expert's start
    for c0 in range(0, capacity, BLOCK_C):  # padding everywhere first ...
        offs_c = c0 + tl.arange(0, BLOCK_C)
        tl.store(sorted_ids_ptr + offs_c, tl.zeros([BLOCK_C], tl.int32) + num_pairs,
                 mask=offs_c < capacity)
    tl.debug_barrier()  # ... (stored by all threads of the program) then the pairs over it
    tl.store(sorted_ids_ptr + start + rank, offs_t, mask=t_mask)
    # Block b belongs to the first expert whose padded group ends after b * BLOCK_M (as
    # searchsorted(padded_end, b * BLOCK_M, right=True)); blocks past the total get the last.
    offs_b = tl.arange(0, BLOCK_B)
    ended = (padded_end[None, :] <= (offs_b * BLOCK_M)[:, None]) & (offs_e < num_experts)[None, :]
    expert = tl.minimum(tl.sum(ended.to(tl.int32), axis=1), num_experts - 1)
    tl.store(block_expert_ptr + offs_b, expert, mask=offs_b < capacity // BLOCK_M)
    tl.store(num_padded_ptr, tl.sum(padded, axis=0))


@triton.jit
def _grouped_matmul_kernel(
    a_ptr,  # [rows, K]: x (row = pair // TOP_K) or the intermediate (row = pair)
    w_ptr,  # [E, N (GATED: 2N = gate | up), K], contiguous K
    out_ptr,  # [num_pairs, N] contiguous
    topk_weights_ptr,  # [num_pairs] float32 (MUL_WEIGHT)
    sorted_ids_ptr,
    block_expert_ptr,
    num_padded_ptr,
    num_pairs,
    N,
    K,
    stride_am,
    stride_we,
    stride_wn,
    TOP_K: tl.constexpr,  # pairs per row of a (k for x, 1 for the intermediate)
    GATED: tl.constexpr,  # out = silu(a @ gate^T) * (a @ up^T)
    MUL_WEIGHT: tl.constexpr,  # out = (a @ w^T) * topk_weight of the pair
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for float32 (no tf32 rounding), else "tf32"
):
    pid_m = tl.program_id(0)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return  # a block past the padded total (the launch covers the capacity)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_ids_ptr + offs_m)
    row_mask = pairs < num_pairs  # padding rows hold num_pairs
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (pairs // TOP_K).to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    # A [BLOCK_K, BLOCK_N] tile of the expert's W^T.
    w_ptrs = w_ptr + expert * stride_we + offs_n.to(tl.int64)[None, :] * stride_wn + offs_k[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k0
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & n_mask[None, :]
        acc = tl.dot(a, tl.load(w_ptrs, mask=w_mask, other=0.0), acc,
                     input_precision=DOT_PRECISION)
        if GATED:  # the up_proj rows sit N rows below the gate_proj rows
            w_up = tl.load(w_ptrs + N * stride_wn, mask=w_mask, other=0.0)
            acc_up = tl.dot(a, w_up, acc_up, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    dtype = out_ptr.dtype.element_ty
    out = acc.to(dtype).to(tl.float32)
    if GATED:  # rounded where silu_and_mul_ref rounds: the matmuls, silu, the product
        out = (out / (1.0 + tl.exp(-out))).to(dtype).to(tl.float32)
        out = out * acc_up.to(dtype).to(tl.float32)
    if MUL_WEIGHT:
        out = out * tl.load(topk_weights_ptr + pairs, mask=row_mask, other=0.0)[:, None]
    out_ptrs = out_ptr + pairs.to(tl.int64)[:, None] * N + offs_n[None, :]
    tl.store(out_ptrs, out.to(dtype), mask=row_mask[:, None] & n_mask[None, :])


def _check(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
           topk_ids: torch.Tensor) -> None:  # fmt: skip
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"fused_moe: x {tuple(x.shape)} must be [M, H], w13 {tuple(w13.shape)} "
                         f"[E, 2I, H], w2 {tuple(w2.shape)} [E, H, I]")
    num_experts, two_inter, hidden = w13.shape
    if (x.shape[1] != hidden or two_inter % 2 or tuple(w2.shape)
            != (num_experts, hidden, two_inter // 2)):  # fmt: skip
        raise ValueError(f"fused_moe: shapes disagree: x {tuple(x.shape)}, w13 "
                         f"{tuple(w13.shape)} [E, 2I, H], w2 {tuple(w2.shape)} [E, H, I]")
    if topk_ids.dim() != 2 or topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != len(x):
        raise ValueError(f"fused_moe: topk_ids {tuple(topk_ids.shape)} and topk_weights "
                         f"{tuple(topk_weights.shape)} must both be [M, k] for M = {len(x)}")
    if x.stride(1) != 1 or not w13.is_contiguous() or not w2.is_contiguous():
        raise ValueError("fused_moe: x needs a contiguous last axis, w13 and w2 contiguous")


def fused_moe_triton(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    config: MoeConfig | None = None,
    align_kernel: bool | None = None,
) -> torch.Tensor:
    """The contract of fused_moe_ref (kernels/fused_reference.py) -> [M, H] in x's dtype.

    `config` overrides the tiles, `align_kernel` moe_align_block_size's choice (tests,
    benchmarks, tuning sweeps).
    """
    _check(x, w13, w2, topk_weights, topk_ids)
    num_tokens, top_k = topk_ids.shape
    num_experts, hidden, inter = w2.shape
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return x.new_zeros((num_tokens, hidden))
    cfg = config or moe_config(num_pairs, num_experts)
    sorted_ids, block_expert, num_padded = moe_align_block_size(topk_ids, cfg.block_m,
                                                                num_experts, align_kernel)
    weights = topk_weights.to(torch.float32).contiguous()
    num_blocks = sorted_ids.numel() // cfg.block_m
    launch = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                  DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages)  # fmt: skip
    hidden_act = x.new_empty((num_pairs, inter))
    _grouped_matmul_kernel[(num_blocks, triton.cdiv(inter, cfg.block_n))](
        x, w13, hidden_act, weights, sorted_ids, block_expert, num_padded, num_pairs, inter,
        hidden, x.stride(0), w13.stride(0), w13.stride(1), TOP_K=top_k, GATED=True,
        MUL_WEIGHT=False, **launch,
    )  # fmt: skip
    expert_out = x.new_empty((num_pairs, hidden))
    _grouped_matmul_kernel[(num_blocks, triton.cdiv(hidden, cfg.block_n))](
        hidden_act, w2, expert_out, weights, sorted_ids, block_expert, num_padded, num_pairs,
        hidden, inter, hidden_act.stride(0), w2.stride(0), w2.stride(1), TOP_K=1, GATED=False,
        MUL_WEIGHT=True, **launch,
    )  # fmt: skip
    return expert_out.view(num_tokens, top_k, hidden).sum(dim=1, dtype=torch.float32).to(x.dtype)
