"""A step in which some row asks for an optional feature (its Sequence has extras): the
features' logits processing and logprobs (sample/logits_features.py) around the runner's
forward and sampler, and speculative decoding's verification rows (spec_decode/). A plain step
never comes here: ModelRunner.run checks with one line.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from myvllm.config import Config
from myvllm.engine.batch import SamplingArgs, StepInputs
from myvllm.engine.sequence import Sequence
from myvllm.layers.sampler import Sampler
from myvllm.sample.logits_features import LogitsFeatures
from myvllm.sample.logprobs import StepLogprobs
from myvllm.sample.sampling_controls import prepare_min_ps, seeded_generators
from myvllm.utils.context import forward_context
from myvllm.worker.input_builder import InputBuilder
from myvllm.worker.model_loading import CausalLM
from myvllm.worker.staging import FreshTensors, SampledTokens, VerifiedRows


class Verifying(Protocol):
    """A step's rows that verify proposals (spec_decode/verification.py's VerificationStep),
    as their sampling meets them."""

    @property
    def verified(self) -> VerifiedRows | None: ...

    def verify(self, logits: torch.Tensor, args: SamplingArgs, to_device: Any
               ) -> torch.Tensor: ...

    def logits(self, hidden: torch.Tensor,
               compute_logits: Callable[[torch.Tensor], torch.Tensor | None],
               fresh: FreshTensors) -> torch.Tensor | None: ...


class FeatureRunner(Protocol):
    """A ModelRunner (engine/model_runner.py), as a step with features runs on it."""

    config: Config
    rank: int
    device: torch.device
    inputs: InputBuilder
    model: CausalLM
    sampler: Sampler
    eos_token_ids: frozenset[int]
    hf_config: Any
    verifier: Any  # spec_decode's Verifier, or None when speculation is off

    def prefill_hidden(self, step: StepInputs) -> torch.Tensor: ...

    def run_decode(self, seqs: list[Sequence]) -> torch.Tensor | None: ...

    def sampling_args(self, seqs: list[Sequence]) -> SamplingArgs: ...

    def return_tokens(self, seqs: list[Sequence], tokens: torch.Tensor | None,
                      logprobs: StepLogprobs | None = None) -> SampledTokens | None: ...


def run_feature_step(runner: FeatureRunner, seqs: list[Sequence], is_prefill: bool,
                     samples: list[bool]) -> SampledTokens | None:
    """ModelRunner.run for a step where some row has extras; samples: whether each row's
    token this step is its next (model_runner.samples_this_step)."""
    # Before the forward: it reads pending tokens from the pool, which a decode graph
    # overwrites with its own samples.
    features = LogitsFeatures(seqs, samples, is_prefill, runner.rank,
                              runner.inputs.fresh.tensor, runner.inputs.pool.tokens,
                              runner.eos_token_ids)
    if runner.verifier is not None:
        verification = runner.verifier.step(seqs, features)
        if verification is not None:  # rows verify proposals (spec_decode/)
            sampled: SampledTokens | None = verification.run(runner, features)
            return sampled
    logits = (forward_prefill_with_features(runner, seqs, features) if is_prefill
              else runner.run_decode(seqs))
    return sample_with_features(runner, seqs, logits, features)


def forward_prefill_with_features(runner: FeatureRunner, seqs: list[Sequence],
                                  features: LogitsFeatures,
                                  verification: Verifying | None = None) -> torch.Tensor | None:
    """ModelRunner.forward_prefill with the features' prompt logprobs (the LM head over
    those prompt rows too); with verification rows, the logits of all their positions."""
    step = runner.inputs.prepare_prefill(seqs)
    with forward_context(step.context):
        hidden = runner.prefill_hidden(step)
        # The LM head reads each sequence's last row (context.cu_seqlens_q), never padding.
        logits = runner.model.compute_logits(hidden) if verification is None else None
    if verification is not None:
        logits = verification.logits(hidden, runner.model.compute_logits, runner.inputs.fresh)
    features.add_prompt_logprobs(hidden, runner.model.compute_logits,
                                 runner.config.max_num_sequences)
    return logits


def sample_with_features(runner: FeatureRunner, seqs: list[Sequence],
                         logits: torch.Tensor | None, features: LogitsFeatures,
                         verification: Verifying | None = None) -> SampledTokens | None:
    """ModelRunner.sample with the features' logits processing and logprobs, after rejection
    sampling of the verification rows when there are some."""
    tokens = None
    if runner.rank == 0 and logits is not None:
        args = runner.sampling_args(seqs)
        # Seeds and min-p: sampling controls, asked for only by a row with extras.
        args.generators = seeded_generators(seqs, features.samples, runner.device)
        args.min_ps = prepare_min_ps(seqs, runner.inputs.fresh.tensor)
        if verification is not None:  # rejection sampling, then each row's last logits
            logits = verification.verify(logits, args, runner.inputs.fresh.tensor)
        tokens = features.sample(runner.sampler, logits[:len(seqs)], args,
                                 runner.hf_config.vocab_size)
    sampled = runner.return_tokens(seqs, tokens, features.logprobs)
    if sampled is not None and verification is not None:
        sampled.verified = verification.verified
    return sampled
