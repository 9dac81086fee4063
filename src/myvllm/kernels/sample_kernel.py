"""Triton kernel: temperature sampling of a whole batch in one pass over the logits.

The PyTorch sampler (layers/sampler.py) runs about ten full passes over a [batch, vocab]
float32 tensor per step: cast, divide by the temperature, softmax, draw noise, clamp,
divide, argmax. With 256 sequences and Qwen3's 151,936-token vocabulary that is ~1 ms of
an H200 decode step (measured, docs/benchmarks.md). This kernel reads each logit once.

It samples with the Gumbel-max trick in log space, which is the sampler's exponential
trick with the softmax normalisation dropped (it does not change the argmax):

    argmax_i  p_i / E_i  =  argmax_i  logit_i / T - log(E_i),   E_i = -log(U_i) ~ Exp(1)

One program per row walks the vocabulary in tiles, keeping the best score and its index.
U_i comes from Triton's Philox generator keyed by (the row's seed, i): the caller draws one
seed per row per step from torch's generator, so torch.manual_seed still makes a run
repeatable. Rows with temperature 0 take the plain argmax of the logits (no noise); ties
go to the lowest token id, as torch.argmax does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gumbel_sample_kernel(
    logits_ptr,  # [B, V]
    temperatures_ptr,  # [B] float32, 0 = greedy
    seeds_ptr,  # [B] int64
    out_ptr,  # [B] int64
    stride_row,
    vocab_size,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    temperature = tl.load(temperatures_ptr + row)
    greedy = temperature == 0.0
    safe_temperature = tl.where(greedy, 1.0, temperature)
    seed = tl.load(seeds_ptr + row)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    best_score = float("-inf")
    best_index = 0
    for start in range(0, vocab_size, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < vocab_size
        logits = tl.load(row_ptr + offs, mask=mask, other=float("-inf")).to(tl.float32)
        uniform = tl.rand(seed, offs)  # [0, 1)
        # E = 0 has probability ~0 but would give log(0); clamp as the PyTorch sampler does.
        exponential = tl.maximum(-tl.log(uniform), 1e-10)
        score = tl.where(greedy, logits, logits / safe_temperature - tl.log(exponential))
        score = tl.where(mask, score, float("-inf"))
        tile_best = tl.max(score, axis=0)
        tile_index = start + tl.argmax(score, axis=0)
        better = tile_best > best_score  # strict: an earlier tile wins a tie
        best_index = tl.where(better, tile_index, best_index)
        best_score = tl.where(better, tile_best, best_score)
    tl.store(out_ptr + row, best_index.to(tl.int64))


def gumbel_sample_triton(
    logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor
) -> torch.Tensor:
    """logits [B, V]; temperatures [B] (0 = greedy); seeds [B] int64 -> token ids [B] int64."""
    batch, vocab_size = logits.shape
    if logits.stride(-1) != 1:
        raise ValueError("gumbel_sample: logits need a contiguous vocabulary axis")
    if temperatures.shape != (batch,) or seeds.shape != (batch,):
        raise ValueError(f"gumbel_sample: temperatures {tuple(temperatures.shape)} and seeds "
                         f"{tuple(seeds.shape)} must both be [{batch}]")
    out = torch.empty(batch, dtype=torch.int64, device=logits.device)
    if batch == 0:
        return out
    block = min(4096, triton.next_power_of_2(vocab_size))
    _gumbel_sample_kernel[(batch,)](
        logits, temperatures.float(), seeds, out, logits.stride(0), vocab_size,
        BLOCK=block, num_warps=8 if block >= 2048 else 4,
    )  # fmt: skip
    return out
