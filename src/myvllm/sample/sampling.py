"""Sampling set-up: each sequence's SamplingParams as the Sampler's per-row arguments.

Rank 0 alone samples. A decode step on one GPU whose rows only use temperature samples inside
its CUDA graph (layers/sampler.py); a row with more (sampling_controls.needs_full_sampler)
makes the step run the LM head and the Sampler outside the graph, on the logits.
"""

from __future__ import annotations

import torch

from myvllm.engine.batch import SamplingArgs
from myvllm.sample.extras import proposals_of
from myvllm.sample.sampling_controls import ToDevice, generator_for, prepare_min_ps
from myvllm.engine.sequence import Sequence


def samples_this_step(seq: Sequence) -> bool:
    """The step's chunk reaches the sequence's last token (a decode row always does, and
    a row verifying proposals reaches past it, to the last proposal)."""
    num_proposals = len(seq.extras.spec_token_ids) if seq.extras is not None else 0
    return seq.num_computed_tokens == seq.num_tokens + num_proposals


def prepare_sample(seqs: list[Sequence], to_device: ToDevice, device: torch.device
                   ) -> SamplingArgs:
    """Sampling settings as device tensors, plus host-side hints for the fast paths.

    A row whose chunk stops short of its last token draws nothing from its seeded generator,
    or its later tokens would depend on how its prompt was cut.
    """
    params = [seq.sampling_params for seq in seqs]
    generators: list[torch.Generator | None] | None = None
    if any(p.seed is not None for p in params):
        # A row verifying proposals draws from its generator in the rejection sampler.
        generators = [generator_for(seq, device)
                      if samples_this_step(seq) and not proposals_of(seq) else None
                      for seq in seqs]
    use_top_k = any(p.top_k > 0 for p in params)
    use_top_p = any(p.top_p < 1.0 for p in params)
    return SamplingArgs(
        temperatures=to_device([p.temperature for p in params], torch.float32),
        top_ks=to_device([p.top_k for p in params], torch.int64) if use_top_k else None,
        top_ps=to_device([p.top_p for p in params], torch.float32) if use_top_p else None,
        generators=generators,
        # min-p is a sampling control: its rows have extras (engine/sequence.py).
        min_ps=(prepare_min_ps(seqs, to_device)
                if any(seq.extras is not None for seq in seqs) else None),
        all_greedy=all(p.temperature == 0 for p in params),
    )
