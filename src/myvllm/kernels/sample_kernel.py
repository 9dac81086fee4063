"""Triton kernel: temperature sampling of a whole batch in one pass over the logits.

The PyTorch sampler (layers/sampler.py) runs about ten full passes over a [batch, vocab]
float32 tensor per step: cast, divide by the temperature, softmax, draw noise, clamp,
divide, argmax. With 256 sequences and Qwen3's 151,936-token vocabulary that is ~1 ms of
an H200 decode step (measured, docs/benchmarks.md). This kernel reads each logit once.

It samples with the Gumbel-max trick in log space, which is the sampler's exponential
trick with the softmax normalisation dropped (it does not change the argmax):

    argmax_i  p_i / E_i  =  argmax_i  logit_i / T - log(E_i),   E_i = -log(U_i) ~ Exp(1)

Programs split every row into vocabulary chunks and keep each chunk's best score and its
token id; a small argmax over the chunks picks the winner. U_i comes from Triton's Philox
generator keyed by (the row's seed, i // 4), four numbers per call: the caller draws one
seed per row per step from torch's generator, so torch.manual_seed still makes a run
repeatable. Rows with temperature 0 take the plain argmax of the logits (no noise); ties
go to the lowest token id, as torch.argmax does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_args, pdl_wait


@triton.jit
def _gumbel_sample_kernel(
    logits_ptr,  # [B, V]
    temperatures_ptr,  # [B] float32, 0 = greedy
    seeds_ptr,  # [B] int64
    best_score_ptr,  # [B, NUM_CHUNKS] float32: each chunk's best score ...
    best_index_ptr,  # [B, NUM_CHUNKS] int64: ... and the token id that has it
    stride_row,
    vocab_size,
    NUM_CHUNKS: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,  # kernels/pdl.py
):
    pdl_wait(USE_PDL)
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    temperature = tl.load(temperatures_ptr + row)
    greedy = temperature == 0.0
    safe_temperature = tl.where(greedy, 1.0, temperature)
    seed = tl.load(seeds_ptr + row)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < vocab_size
    logits = tl.load(logits_ptr + row.to(tl.int64) * stride_row + offs, mask=mask,
                     other=float("-inf")).to(tl.float32)  # fmt: skip
    # One Philox call gives four uniforms [0, 1): token id 4q + j gets number j of the call
    # with counter q (in the order the joins lay them out). That is the same for a (seed,
    # token id) in any chunking, and a quarter of the generator work of one call per token,
    # which dominated this kernel at batch 256 (~0.2 ms per step on the H200).
    quarter = chunk * (BLOCK // 4) + tl.arange(0, BLOCK // 4)
    u0, u1, u2, u3 = tl.rand4x(seed, quarter)
    uniform = tl.reshape(tl.join(tl.join(u0, u1), tl.join(u2, u3)), [BLOCK])
    # E = 0 has probability ~0 but would give log(0); clamp as the PyTorch sampler does.
    exponential = tl.maximum(-tl.log(uniform), 1e-10)
    score = tl.where(greedy, logits, logits / safe_temperature - tl.log(exponential))
    score = tl.where(mask, score, float("-inf"))
    out = row * NUM_CHUNKS + chunk
    tl.store(best_score_ptr + out, tl.max(score, axis=0))
    tl.store(best_index_ptr + out, (chunk * BLOCK + tl.argmax(score, axis=0)).to(tl.int64))


def gumbel_sample_triton(
    logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor
) -> torch.Tensor:
    """logits [B, V]; temperatures [B] (0 = greedy); seeds [B] int64 -> token ids [B] int64.

    Two stages: the kernel finds the best (score, token) of every BLOCK-wide chunk of every
    row, with B x NUM_CHUNKS programs so the whole GPU works even at batch 1; then a
    [B, NUM_CHUNKS] argmax picks each row's winner (torch.argmax takes the first maximum,
    so a tie goes to the lower token id, as in the kernel's tl.argmax).
    """
    batch, vocab_size = logits.shape
    if logits.stride(-1) != 1:
        raise ValueError("gumbel_sample: logits need a contiguous vocabulary axis")
    if temperatures.shape != (batch,) or seeds.shape != (batch,):
        raise ValueError(f"gumbel_sample: temperatures {tuple(temperatures.shape)} and seeds "
                         f"{tuple(seeds.shape)} must both be [{batch}]")
    if batch == 0:
        return torch.empty(0, dtype=torch.int64, device=logits.device)
    block = min(2048, max(4, triton.next_power_of_2(vocab_size)))  # a multiple of 4
    num_chunks = triton.cdiv(vocab_size, block)
    best_score = torch.empty((batch, num_chunks), dtype=torch.float32, device=logits.device)
    best_index = torch.empty((batch, num_chunks), dtype=torch.int64, device=logits.device)
    _gumbel_sample_kernel[(batch, num_chunks)](
        logits, temperatures.float(), seeds, best_score, best_index, logits.stride(0),
        vocab_size, NUM_CHUNKS=num_chunks, BLOCK=block, **pdl_args(logits),
        num_warps=4,
    )  # fmt: skip
    winner = best_score.argmax(dim=1, keepdim=True)
    return best_index.gather(1, winner).squeeze(1)
