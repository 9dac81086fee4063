"""Turn each sequence's last-token logits into the next token.

    temperature == 0   greedy: argmax of the raw logits
    otherwise          logits / temperature -> min-p -> top-k -> top-p -> sample

Sampling is the exponential ("Gumbel-max") trick, argmax(p / E) with E ~ Exponential(1): no
host sync; a seeded row draws E from its own generator. Logit bias, min_tokens and penalties
were applied before (layers/logits_processors.py), and so was a structured output's token
bitmask (layers/token_bitmask.py). The draw of a batch that is not all greedy is
layers/sampler_ops.py's; on the GPU a batch with no filters, min-p or seeds is sampled by
kernels/sample_kernel.py.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from myvllm.layers.sampler_ops import sample_with_temperature


class Sampler(nn.Module):
    def forward(
        self, logits: torch.Tensor, temperatures: torch.Tensor,
        top_ks: torch.Tensor | None = None, top_ps: torch.Tensor | None = None,
        generators: Sequence[torch.Generator | None] | None = None, *,
        all_greedy: bool | None = None, min_ps: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """logits [B, V]; temperatures [B] float (0 = greedy); top_ks [B] int (-1 or <= 0 = off);
        top_ps [B] float (1.0 = off); generators: one per row or None; min_ps [B] float
        (0 = off) -> token ids [B] int64.

        ``all_greedy`` is a host-side hint; when None it is computed from ``temperatures``,
        which syncs with the device.
        """
        if all_greedy is None:
            all_greedy = bool((temperatures == 0).all())
        if all_greedy:
            return logits.argmax(dim=-1)

        # Temperature, min-p, top-k / top-p and seeds: the draw (layers/sampler_ops.py).
        return sample_with_temperature(logits, temperatures, top_ks, top_ps, generators, min_ps)
