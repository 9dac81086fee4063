"""Rejection sampling: keep a prefix of the proposed tokens, and end on one token of the
target's own, so that every emitted token is distributed exactly as if the target model
had sampled it alone (Leviathan et al. 2023; Chen et al. 2023; vLLM's RejectionSampler).

Per sequence, with k proposals d_1..d_k and the target's distributions p_1..p_{k+1} from
one forward pass (p_j is conditioned on the tokens before d_j, proposals included):

    for j = 1..k:
        accept d_j with probability min(1, p_j(d_j) / q_j(d_j))
        on the first rejection: emit a token drawn from norm(max(0, p_j - q_j)), stop
    all accepted: emit a "bonus" token drawn from p_{k+1}

Why the result is p_j: the emitted token is x = d_j with probability
q(x) * min(1, p(x)/q(x)) = min(q(x), p(x)), and otherwise comes from the residual, whose
mass is 1 - sum_x min(p(x), q(x)) = sum_x max(0, p(x) - q(x)); together
min(p, q) + max(0, p - q) = p. An accepted token is exactly the target's own draw, so the
next position is conditioned correctly too.

q is the proposer's distribution. Prompt lookup (the n-gram proposer) is deterministic:
q = one-hot at d_j, so d_j is accepted with probability p_j(d_j), and the residual is p_j
with d_j removed. A greedy row (temperature 0) accepts d_j exactly when it is the argmax, and
emits the argmax at the first mismatch: the same tokens as decoding one at a time.

Temperature, top-k and top-p shape p before any of this (the Sampler's filters); a row's
seeded generator draws its uniforms and its noise.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# The Sampler's top-k / top-p filter: the same p for a verification row as for a decode row.
from myvllm.layers.sampler_ops import top_k_top_p

PLACEHOLDER = -1  # in the output, positions after the emitted tokens


def rejection_sample(
    target_logits: torch.Tensor,
    draft_token_ids: torch.Tensor,
    num_draft_tokens: Sequence[int],
    temperatures: torch.Tensor,
    top_ks: torch.Tensor | None = None,
    top_ps: torch.Tensor | None = None,
    generators: Sequence[torch.Generator | None] | None = None,
    draft_probs: torch.Tensor | None = None,
    *,
    all_greedy: bool = False,
) -> torch.Tensor:
    """target_logits [B, K+1, V]: row b's logits at its last token and its K proposals
    (positions past num_draft_tokens[b] + 1 are padding); draft_token_ids [B, K] int64
    (padded); num_draft_tokens: B host ints <= K; temperatures [B] (0 = greedy), top_ks /
    top_ps [B] or None as for the Sampler; generators: one per row or None; draft_probs
    [B, K, V] the proposer's distributions, or None for a deterministic proposer (one-hot).

    Returns [B, K+1] int64: row b's emitted tokens (accepted proposals, then one token of
    the target's), then PLACEHOLDER. Each row emits 1 .. num_draft_tokens[b] + 1 tokens.
    """
    batch, width, vocab = target_logits.shape
    k = width - 1
    if draft_token_ids.shape != (batch, k):
        raise ValueError(f"draft_token_ids has shape {tuple(draft_token_ids.shape)}, "
                         f"expected {(batch, k)}")
    if len(num_draft_tokens) != batch or any(not 0 <= n <= k for n in num_draft_tokens):
        raise ValueError(f"num_draft_tokens must be {batch} ints in [0, {k}], "
                         f"got {list(num_draft_tokens)}")
    device = target_logits.device
    positions = torch.arange(width, device=device)
    # From pinned memory without waiting: a plain torch.tensor(..., device=cuda) copies from
    # pageable memory and makes the host wait for everything queued before it.
    num_drafts = torch.tensor(list(num_draft_tokens), dtype=torch.int64)
    if device.type == "cuda":
        num_drafts = num_drafts.pin_memory()
    num_drafts = num_drafts.to(device, non_blocking=True)
    is_draft = positions[:k].unsqueeze(0) < num_drafts.unsqueeze(1)  # [B, K]
    greedy_tokens = target_logits.argmax(dim=-1)  # [B, K+1], argmax of the raw logits
    if all_greedy:
        accepted = draft_token_ids == greedy_tokens[:, :k]
        emitted = greedy_tokens
    else:
        probs = target_probs(target_logits, temperatures, top_ks, top_ps)
        p_draft = probs[:, :k].gather(-1, draft_token_ids.unsqueeze(-1)).squeeze(-1)
        if draft_probs is None:  # deterministic proposer: q(d) = 1, q = one-hot
            q = torch.zeros_like(probs)
            q[:, :k].scatter_(-1, draft_token_ids.unsqueeze(-1), 1.0)
            q_draft = torch.ones_like(p_draft)
        else:
            q = torch.zeros_like(probs)
            q[:, :k] = draft_probs.float()
            q_draft = q[:, :k].gather(-1, draft_token_ids.unsqueeze(-1)).squeeze(-1)
        uniform, noise = _random(batch, width, vocab, device, generators)
        # u < p/q, written without a division: accepts with probability min(1, p/q).
        accept_random = uniform * q_draft < p_draft
        # The bonus position (and padding) has q = 0: the residual there is p itself.
        q = q * torch.cat([is_draft, is_draft.new_zeros(batch, 1)], dim=1).unsqueeze(-1)
        residual = (probs - q).clamp_min_(0.0)
        # Exponential race (the Sampler's trick): argmax r / E is a draw from norm(r).
        sampled = (residual / noise).argmax(dim=-1)
        is_greedy = (temperatures == 0).unsqueeze(1)
        accepted = torch.where(is_greedy, draft_token_ids == greedy_tokens[:, :k],
                               accept_random)
        emitted = torch.where(is_greedy, greedy_tokens, sampled)
    accepted &= is_draft
    # Accepted count: the leading run of acceptances (cumprod stops at the first rejection).
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)  # [B]
    out = torch.full((batch, width), PLACEHOLDER, dtype=torch.int64, device=device)
    out[:, :k] = torch.where(positions[:k].unsqueeze(0) < num_accepted.unsqueeze(1),
                             draft_token_ids, PLACEHOLDER)
    last = num_accepted.unsqueeze(1)
    out.scatter_(1, last, emitted.gather(1, last))
    return out


def target_probs(logits: torch.Tensor, temperatures: torch.Tensor,
                  top_ks: torch.Tensor | None, top_ps: torch.Tensor | None) -> torch.Tensor:
    """softmax(filter(logits / T)) at every position, each row's settings for all of its
    positions. Greedy rows divide by 1 (their p is not read)."""
    batch, width, vocab = logits.shape
    temps = torch.where(temperatures == 0, torch.ones_like(temperatures), temperatures)
    flat = logits.float().reshape(batch * width, vocab)
    flat = flat / temps.float().repeat_interleave(width).unsqueeze(-1)
    if top_ks is not None or top_ps is not None:
        flat = top_k_top_p(flat,
                            top_ks.repeat_interleave(width) if top_ks is not None else None,
                            top_ps.repeat_interleave(width) if top_ps is not None else None)
    return torch.softmax(flat, dim=-1).reshape(batch, width, vocab)


def _random(batch: int, width: int, vocab: int, device: torch.device,
            generators: Sequence[torch.Generator | None] | None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniforms [B, K] for the acceptance tests and Exponential(1) noise [B, K+1, V] for
    the residual draws; a seeded row's come from its own generator alone."""
    uniform = torch.rand(batch, width - 1, device=device)
    noise = torch.empty(batch, width, vocab, device=device).exponential_()
    if generators is not None:
        if len(generators) != batch:
            raise ValueError(f"generators has {len(generators)} entries for {batch} rows")
        for row, generator in enumerate(generators):
            if generator is not None:
                uniform[row] = torch.rand(width - 1, device=device, generator=generator)
                noise[row].exponential_(generator=generator)
    # E = 0 has probability ~0 but would divide by zero.
    return uniform, noise.clamp_min_(1e-10)
