"""Sampling controls that rewrite a batch's logits before the Sampler draws from them.

Each control is one function over the rows that asked for it, in vLLM's order:

    raw logits                                   (logprobs are read here: vLLM's default)
      -> apply_logit_bias     logit += bias[token]                      SamplingParams.logit_bias
      -> apply_banned_tokens  eos, stop_token_ids -> -inf               min_tokens, while short
      -> apply_penalties      repetition (prompt + completion tokens),  repetition_penalty,
                              then frequency and presence (completion)  frequency_/presence_penalty
      -> Sampler: temperature -> apply_min_p -> top-k / top-p -> sample (layers/sampler.py)

process_logits runs the first three on a float32 copy; a step with none of them never calls
it, so rows that ask for nothing cost nothing. Another per-token mask (a grammar's bitmask)
is one more function of this shape, applied beside them.

The penalties, with c(t) the times token t is in the completion so far and r, f, p a row's
repetition, frequency and presence penalties:

    logit(t) = logit(t) / r   if logit(t) > 0 and t is in the prompt or the completion
               logit(t) * r   if logit(t) <= 0 and likewise        (transformers' and vLLM's)
    logit(t) -= f * c(t) + p * (c(t) > 0)                           (OpenAI's definition)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LogitBias:
    """One entry per (row, token) pair to bias, flat over the batch."""

    rows: torch.Tensor  # [K] int64, rows of the batch
    token_ids: torch.Tensor  # [K] int64
    values: torch.Tensor  # [K] float32, added to the logit


@dataclass
class BannedTokens:
    """(row, token) pairs that may not be sampled this step (min_tokens: eos and
    stop_token_ids of the rows whose completion is still short)."""

    rows: torch.Tensor  # [M] int64
    token_ids: torch.Tensor  # [M] int64


@dataclass
class Penalties:
    """The penalised rows and their token history, as flat (row, token) pairs.

    A row's index here is its place in `rows` (0..P-1), not its row of the batch.
    """

    rows: torch.Tensor  # [P] int64, rows of the batch
    presence: torch.Tensor  # [P] float32, 0 = off
    frequency: torch.Tensor  # [P] float32, 0 = off
    repetition: torch.Tensor  # [P] float32, 1 = off
    output_rows: torch.Tensor  # [N] int64 in [0, P): one entry per completion token
    output_token_ids: torch.Tensor  # [N] int64
    prompt_rows: torch.Tensor  # [Q] int64 in [0, P): prompt tokens (repetition only)
    prompt_token_ids: torch.Tensor  # [Q] int64


@dataclass
class LogitsProcessing:
    """The controls that act on a step's logits before sampling; None = that control is off
    for every row."""

    logit_bias: LogitBias | None = None
    banned: BannedTokens | None = None
    penalties: Penalties | None = None


def process_logits(logits: torch.Tensor, processing: LogitsProcessing) -> torch.Tensor:
    """logits [B, V] (not modified) -> a float32 copy with the controls applied."""
    logits = logits.float().clone()  # .float() alone returns the same tensor for float32
    if processing.logit_bias is not None:
        apply_logit_bias(logits, processing.logit_bias)
    if processing.banned is not None:
        apply_banned_tokens(logits, processing.banned)
    if processing.penalties is not None:
        apply_penalties(logits, processing.penalties)
    return logits


def apply_logit_bias(logits: torch.Tensor, bias: LogitBias) -> None:
    """In place: logits[row, token] += value for each entry."""
    logits.index_put_((bias.rows, bias.token_ids), bias.values, accumulate=True)


def apply_banned_tokens(logits: torch.Tensor, banned: BannedTokens) -> None:
    """In place: -inf at each (row, token)."""
    logits.index_put_((banned.rows, banned.token_ids),
                      torch.tensor(float("-inf"), device=logits.device))


def token_counts(num_rows: int, vocab_size: int, rows: torch.Tensor, token_ids: torch.Tensor,
                 device: torch.device) -> torch.Tensor:
    """[num_rows, vocab_size] float32: how often each token occurs in each row's list."""
    counts = torch.zeros(num_rows, vocab_size, dtype=torch.float32, device=device)
    ones = torch.ones(token_ids.shape, dtype=torch.float32, device=device)
    return counts.index_put_((rows, token_ids), ones, accumulate=True)


def apply_penalties(logits: torch.Tensor, penalties: Penalties) -> None:
    """In place, on the penalised rows: the formulas of the module docstring."""
    num_rows, vocab_size = penalties.rows.numel(), logits.shape[-1]
    device = logits.device
    counts = token_counts(num_rows, vocab_size, penalties.output_rows,
                          penalties.output_token_ids, device)
    in_output = counts > 0
    seen = in_output.clone()
    seen[penalties.prompt_rows, penalties.prompt_token_ids] = True
    rows = logits[penalties.rows]  # a copy of the P rows, written back below
    repetition = torch.where(seen, penalties.repetition.unsqueeze(-1), 1.0)
    rows = torch.where(rows > 0, rows / repetition, rows * repetition)
    rows -= penalties.frequency.unsqueeze(-1) * counts
    rows -= penalties.presence.unsqueeze(-1) * in_output
    logits[penalties.rows] = rows


def apply_min_p(logits: torch.Tensor, min_ps: torch.Tensor) -> torch.Tensor:
    """logits [B, V] after temperature; min_ps [B] (0 = off) -> -inf where a token's
    probability is below min_p times its row's most likely token's (which always stays)."""
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_ps.unsqueeze(-1)
    return logits.masked_fill(probs < threshold, float("-inf"))
