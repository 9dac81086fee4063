"""Triton kernels: temperature sampling of a whole batch, with the Gumbel-max trick in two levels.

The PyTorch sampler (layers/sampler.py) runs about ten full passes over a [batch, vocab]
float32 tensor per step: cast, divide by the temperature, softmax, draw noise, clamp,
divide, argmax. With 256 sequences and Qwen3's 151,936-token vocabulary that is ~1 ms of
an H200 decode step (measured, docs/benchmarks.md). Here the logits are read once, plus one
chunk per row.

The sampler's trick, in log space (the softmax's normalisation does not move the argmax):

    argmax_i  logit_i / T + G_i,   G_i = -log(-log U_i) ~ Gumbel   is distributed as   softmax

A kernel that drew G_i for every token spent most of its time generating random numbers
(39 million per step at batch 256: ~0.13 ms on the H200, where reading the logits takes
~0.02 ms). The trick composes, so this draws ~2,100 per row instead: split the vocabulary
into chunks, pick a chunk with the trick applied to the chunks' log-masses, then a token
inside it with the trick applied to its tokens:

    P(chunk c) * P(token i | chunk c) = (mass_c / total) * (w_i / mass_c) = softmax_i,
    w_i = exp(logit_i / T), mass_c = sum of w_i over chunk c, total = sum of all w_i

    stats kernel, (row, chunk) programs   each BLOCK-wide chunk of a row: its max m_c of
                                          logits / T and its sum s_c of exp(logits / T - m_c)
                                          (its log-mass is m_c + log s_c)
    pick kernel, one program per row      argmax_c (m_c + log s_c + G_c), then
                                          argmax_i (logit_i / T + G_i) over that chunk
                                          (greedy rows: the first chunk with the row's max,
                                          then the argmax inside it, no noise)

The noise comes from Triton's Philox generator keyed by (the row's seed, a counter): token i
uses counter i, chunk c counter vocab_size + c (the last chunk's padding past the vocabulary
meets those counters too, but its scores are -inf whatever the noise). The caller draws one
seed per row per step from torch's generator, so torch.manual_seed still makes a run
repeatable, also in a CUDA graph.
Rows with temperature 0 take the plain argmax of the logits (no noise); ties go to the lowest
token id, as torch.argmax does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_args, pdl_wait


@triton.jit
def _finite_or_zero(maximum):
    # The max of a chunk of -inf logits only (none in a real model, but possible) is -inf,
    # and exp(x - max) would be exp(-inf - -inf) = NaN; against 0 it is exp(-inf) = 0.
    return tl.where(maximum == float("-inf"), 0.0, maximum)


@triton.jit
def _inverse_temperature(temperature):
    # Greedy rows (T = 0) are scaled by 1: their scores are the raw logits. Both kernels scale
    # through here, so a chunk's tokens carry exactly the mass the stats kernel gave it.
    return 1.0 / tl.where(temperature == 0.0, 1.0, temperature)


@triton.jit
def _gumbel(seed, counters):
    # -log(E), E = -log(U) ~ Exp(1); E = 0 has probability ~0 but would give log(0): clamp
    # it as the PyTorch sampler does.
    return -tl.log(tl.maximum(-tl.log(tl.rand(seed, counters)), 1e-10))


@triton.jit
def _chunk_stats_kernel(
    logits_ptr,  # [B, V]
    temperatures_ptr,  # [B] float32, 0 = greedy
    chunk_max_ptr,  # [B, NUM_CHUNKS] float32: max of logits / T in the chunk (-inf: no mass)
    chunk_sum_ptr,  # [B, NUM_CHUNKS] float32: sum of exp(logits / T - chunk max)
    stride_row,
    vocab_size,
    NUM_CHUNKS: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,  # kernels/pdl.py
):
    pdl_wait(USE_PDL)
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    inv_temperature = _inverse_temperature(tl.load(temperatures_ptr + row))
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    logits = tl.load(logits_ptr + row.to(tl.int64) * stride_row + offs, mask=offs < vocab_size,
                     other=float("-inf")).to(tl.float32)  # fmt: skip
    scaled = logits * inv_temperature
    chunk_max = tl.max(scaled, axis=0)
    out = row * NUM_CHUNKS + chunk
    tl.store(chunk_max_ptr + out, chunk_max)
    tl.store(chunk_sum_ptr + out, tl.sum(tl.exp(scaled - _finite_or_zero(chunk_max)), axis=0))


@triton.jit
def _pick_kernel(
    logits_ptr,
    temperatures_ptr,
    seeds_ptr,  # [B] int64
    chunk_max_ptr,
    chunk_sum_ptr,
    out_ptr,  # [B] int64: the sampled token ids
    stride_row,
    vocab_size,
    NUM_CHUNKS: tl.constexpr,
    CHUNKS_PAD: tl.constexpr,  # next power of two >= NUM_CHUNKS
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_wait(USE_PDL)
    row = tl.program_id(0)
    temperature = tl.load(temperatures_ptr + row)
    greedy = temperature == 0.0
    seed = tl.load(seeds_ptr + row)
    chunks = tl.arange(0, CHUNKS_PAD)
    stats = row * NUM_CHUNKS + chunks
    chunk_max = tl.load(chunk_max_ptr + stats, mask=chunks < NUM_CHUNKS, other=float("-inf"))
    chunk_sum = tl.load(chunk_sum_ptr + stats, mask=chunks < NUM_CHUNKS, other=0.0)
    # A chunk with mass has a sum >= 1 (its max contributes exp(0)); one without has max
    # -inf, and log(1) keeps its score -inf without computing log(0).
    log_mass = chunk_max + tl.log(tl.maximum(chunk_sum, 1.0))
    # Greedy rows take the first chunk that holds the row's max, and no noise anywhere.
    chunk_score = tl.where(greedy, chunk_max, log_mass + _gumbel(seed, vocab_size + chunks))
    chosen = tl.argmax(chunk_score, axis=0)
    offs = chosen * BLOCK + tl.arange(0, BLOCK)
    logits = tl.load(logits_ptr + row.to(tl.int64) * stride_row + offs, mask=offs < vocab_size,
                     other=float("-inf")).to(tl.float32)  # fmt: skip
    scaled = logits * _inverse_temperature(temperature)
    token_score = tl.where(greedy, scaled, scaled + _gumbel(seed, offs))
    # tl.argmax takes the first maximum: a greedy tie goes to the lowest id, as in torch.
    tl.store(out_ptr + row, (chosen * BLOCK + tl.argmax(token_score, axis=0)).to(tl.int64))


def gumbel_sample_triton(
    logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor, chunk_size: int = 2048
) -> torch.Tensor:
    """logits [B, V]; temperatures [B] (0 = greedy); seeds [B] int64 -> token ids [B] int64,
    drawn from softmax(logits / T). ``chunk_size`` (a power of two) splits the vocabulary:
    2,048 gives Qwen3's 151,936 tokens 75 chunks, so B x 75 programs read the logits (the
    whole GPU works even at batch 1), and the pick kernel draws ~2,100 numbers per row."""
    batch, vocab_size = logits.shape
    if logits.stride(-1) != 1:
        raise ValueError("gumbel_sample: logits need a contiguous vocabulary axis")
    if temperatures.shape != (batch,) or seeds.shape != (batch,):
        raise ValueError(f"gumbel_sample: temperatures {tuple(temperatures.shape)} and seeds "
                         f"{tuple(seeds.shape)} must both be [{batch}]")
    if chunk_size < 1 or chunk_size & (chunk_size - 1):
        raise ValueError(f"gumbel_sample: chunk_size must be a power of two, got {chunk_size}")
    out = torch.empty(batch, dtype=torch.int64, device=logits.device)
    if batch == 0:
        return out
    block = min(chunk_size, triton.next_power_of_2(vocab_size))
    num_chunks = triton.cdiv(vocab_size, block)
    chunk_max = torch.empty((batch, num_chunks), dtype=torch.float32, device=logits.device)
    chunk_sum = torch.empty_like(chunk_max)
    temperatures = temperatures.float()
    pdl = pdl_args(logits)
    _chunk_stats_kernel[(batch, num_chunks)](
        logits, temperatures, chunk_max, chunk_sum, logits.stride(0), vocab_size,
        NUM_CHUNKS=num_chunks, BLOCK=block, **pdl, num_warps=4,
    )  # fmt: skip
    _pick_kernel[(batch,)](
        logits, temperatures, seeds, chunk_max, chunk_sum, out,
        logits.stride(0), vocab_size, NUM_CHUNKS=num_chunks,
        CHUNKS_PAD=triton.next_power_of_2(num_chunks), BLOCK=block, **pdl, num_warps=4,
    )  # fmt: skip
    return out
