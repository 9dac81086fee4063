"""Sampling set-up: each sequence's SamplingParams as the Sampler's per-row arguments.

Rank 0 alone samples. A decode step on one GPU whose rows only use temperature samples inside
its CUDA graph (layers/sampler.py); a row with more (needs_full_sampler) makes the step run
the LM head and the Sampler outside the graph, on the logits.
"""

from __future__ import annotations

import torch

from myvllm.engine.batch import SamplingArgs
from myvllm.engine.sampling_controls import ToDevice, prepare_min_ps, uses_sampling_controls
from myvllm.engine.sequence import Sequence


def uses_filters_or_seeds(seq: Sequence) -> bool:
    """top-k, top-p or a seed: what only the PyTorch sampler implements."""
    params = seq.sampling_params
    return params.top_k > 0 or params.top_p < 1.0 or params.seed is not None


def samples_this_step(seq: Sequence) -> bool:
    """The step's chunk reaches the sequence's last token (a decode row always does, and
    a row verifying proposals reaches past it, to the last proposal)."""
    return seq.num_computed_tokens == seq.num_tokens + len(seq.spec_token_ids)


def needs_full_sampler(seqs: list[Sequence]) -> bool:
    """A row needs the logits outside the decode graph: filters, a seed, a sampling control,
    logprobs, or a grammar."""
    return any(uses_filters_or_seeds(seq) or uses_sampling_controls(seq)
               or seq.sampling_params.logprobs is not None
               or seq.grammar_matcher is not None for seq in seqs)


def generator_for(seq: Sequence, device: torch.device) -> torch.Generator | None:
    """The sequence's own generator when it has a seed, made at its first sampled step."""
    seed = seq.sampling_params.seed
    if seed is None:
        return None
    if seq.generator is None:
        seq.generator = torch.Generator(device).manual_seed(seed)
    return seq.generator


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
                      if samples_this_step(seq) and not seq.spec_token_ids else None
                      for seq in seqs]
    use_top_k = any(p.top_k > 0 for p in params)
    use_top_p = any(p.top_p < 1.0 for p in params)
    return SamplingArgs(
        temperatures=to_device([p.temperature for p in params], torch.float32),
        top_ks=to_device([p.top_k for p in params], torch.int64) if use_top_k else None,
        top_ps=to_device([p.top_p for p in params], torch.float32) if use_top_p else None,
        generators=generators,
        min_ps=prepare_min_ps(seqs, to_device),
        all_greedy=all(p.temperature == 0 for p in params),
    )
