"""The typed objects one step passes along: model inputs, sampling arguments, outputs.

    Scheduler.schedule()  -> list[Sequence]
    InputBuilder          -> StepInputs      (token ids, positions, the layers' Context)
    sampling.prepare_sample -> SamplingArgs  (per-row settings as device tensors)
    ModelRunner.run       -> SampledTokens   (worker/token_pool.py)
    EngineCore.step       -> RequestOutput  (per request: its new tokens, finished or not)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from myvllm.sample.extras import LogprobsLists
from myvllm.engine.sequence import FinishReason
from myvllm.utils.context import Context


@dataclass
class StepInputs:
    """What InputBuilder.prepare_prefill / prepare_decode hand to the forward pass."""

    input_ids: torch.Tensor  # [N] int64, the tokens to compute, flat over the batch
    positions: torch.Tensor  # [N] int64, their positions (RoPE)
    context: Context  # how the flat batch splits into sequences and cache slots
    # A decode step's per-row temperatures [N] float32 and where its tokens go (the pool's
    # first N rows): what a decode step that samples in its own forward (a CUDA graph) needs.
    temperatures: torch.Tensor | None = None
    sampled: torch.Tensor | None = None


@dataclass
class SamplingArgs:
    """Per-row sampling settings on the device. What the host knows saves the Sampler a
    device sync (all_greedy: one argmax) and top-k/top-p's sort (None when no row uses it)."""

    temperatures: torch.Tensor  # [B] float32, 0 = greedy
    top_ks: torch.Tensor | None  # [B] int64, <= 0 = off; None when no row filters
    top_ps: torch.Tensor | None  # [B] float32, 1.0 = off; None when no row filters
    generators: list[torch.Generator | None] | None  # per-row seeded generators, or None
    min_ps: torch.Tensor | None  # [B] float32, 0 = off; None when no row uses min-p
    all_greedy: bool


@dataclass
class RequestOutput:
    """What one step did for one request (EngineCore.step)."""

    request_id: int
    new_token_ids: list[int]  # completion tokens that reached the host in this step
    token_ids: list[int]  # the whole completion so far
    finished: bool
    # "stop", "length", "abort", "grammar_too_slow"; None while running
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens whose K/V came from the prefix cache
    # Asked for in SamplingParams, else None: one entry per new token; prompt tokens 1, 2, ...
    # (in the first output of each completion only).
    logprobs: LogprobsLists | None = None
    prompt_logprobs: LogprobsLists | None = None
    # n > 1: which completion these tokens are of, and whether all n have finished.
    index: int = 0
    request_finished: bool = False
