"""Log-probabilities of chosen tokens, and each row's most likely ones, from raw logits.

    logits [R, V] -> log_softmax (float32) -> logprob of token_ids[r] in row r     [R]
                                           -> top-k ids and logprobs per row       [R, k]

They describe the model, not the sampler: computed from the raw logits, before temperature,
top-k and top-p (vLLM's default, and what a client scoring text with logprobs expects: the
same numbers whatever it samples with). The caller passes only the rows that asked, so a step
where no request wants logprobs computes none of this.
"""

from __future__ import annotations

import torch


def gather_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, k: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [R, V] (any float dtype); token_ids [R] int64; k >= 0 ->
    (logprobs [R] float32, top_ids [R, k] int64, top_logprobs [R, k] float32), the top
    sorted most likely first (ties: torch.topk's order)."""
    # float32: bf16's 8 mantissa bits would round a logprob of -0.01 to -0.0100098 and the
    # log-sum-exp of a 150k vocabulary coarsely.
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1)
    top_logprobs, top_ids = logprobs.topk(k, dim=-1)
    return chosen, top_ids, top_logprobs
