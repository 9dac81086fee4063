"""The sampling controls of a step's sequences as the tensors of layers/logits_processors.py.

Built on the host from what each sequence knows, only for the rows that ask: a step in which
no row uses a control builds nothing and never calls process_logits.

Penalties need each row's completion so far. With async scheduling the newest token is
still pending when the next step is planned (Sequence.num_pending_tokens: sampled on the
device, not yet on the host); it is read from its row of the sampled-token pool, on the
device. That read must be queued before the step's forward, because a decode CUDA graph
writes its own sampled tokens into the pool (ModelRunner.run builds these first).

Host cost per step, for the penalised rows only: their completion token ids go to the
device (one list; O(completion length)); the prompt's distinct token ids (repetition
penalty) are copied once per sequence and kept on it.

Beside them, what a step asks of the sampler as a whole: whether some row needs it outside a
decode graph's temperature-only sampling (needs_full_sampler: filters, seeds, a control,
logprobs, a grammar), and a seeded row's own generator (generator_for).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from myvllm.engine.sequence import Sequence
from myvllm.sampling_parameters import SamplingParams
from myvllm.value_checks import refusal
from myvllm.sample.extras import extras_of, proposals_of
from myvllm.layers.logits_processors import BannedTokens, LogitBias, LogitsProcessing, Penalties

# Host values -> a device tensor, without making the host wait (FreshTensors.tensor).
ToDevice = Callable[[list[int] | list[float] | np.ndarray, torch.dtype], torch.Tensor]


def check_sampling_token_ids(params: SamplingParams, vocab_size: int) -> None:
    """logit_bias and stop_token_ids name tokens of the vocabulary (a bias outside it would
    index past the logits on the device)."""
    for name, ids in (("logit_bias", params.logit_bias or ()),
                      ("stop_token_ids", params.stop_token_ids or ())):
        bad = [t for t in ids if t >= vocab_size]
        if bad:
            raise refusal(f"SamplingParams.{name}: token id", bad[0],
                          f"a token id of the vocabulary, [0, {vocab_size})")


# Which rows leave a decode graph's temperature-only sampling, and a seeded row's generator.
def uses_filters_or_seeds(seq: Sequence) -> bool:
    """top-k, top-p or a seed: what only the PyTorch sampler implements."""
    params = seq.sampling_params
    return params.top_k > 0 or params.top_p < 1.0 or params.seed is not None


def needs_full_sampler(seqs: list[Sequence]) -> bool:
    """A row needs the logits outside the decode graph: filters, a seed, a sampling control,
    logprobs, or a grammar."""
    return any(uses_filters_or_seeds(seq) or uses_sampling_controls(seq)
               or seq.sampling_params.logprobs is not None
               or (seq.extras is not None and seq.extras.grammar_matcher is not None)
               for seq in seqs)


def seeded_generators(seqs: list[Sequence], samples: list[bool], device: torch.device
                      ) -> list[torch.Generator | None] | None:
    """Each row's seeded generator, None for a row without a seed; None when no row has one.

    samples: whether each row's token this step is its next (model_runner.samples_this_step).
    A row whose chunk stops short of its last token draws nothing from its generator, or its
    later tokens would depend on how its prompt was cut; a row verifying proposals draws
    from it in the rejection sampler.
    """
    if not any(seq.sampling_params.seed is not None for seq in seqs):
        return None
    return [generator_for(seq, device) if sample and not proposals_of(seq) else None
            for seq, sample in zip(seqs, samples)]


def generator_for(seq: Sequence, device: torch.device) -> torch.Generator | None:
    """The sequence's own generator when it has a seed, made at its first sampled step."""
    seed = seq.sampling_params.seed
    if seed is None:
        return None
    extras = extras_of(seq)
    if extras.generator is None:
        extras.generator = torch.Generator(device).manual_seed(seed)
    return extras.generator


def uses_penalties(seq: Sequence) -> bool:
    p = seq.sampling_params
    return p.presence_penalty != 0 or p.frequency_penalty != 0 or p.repetition_penalty != 1


def short_of_min_tokens(seq: Sequence) -> bool:
    """Fewer than min_tokens completion tokens before the one this step samples (num_tokens
    counts a pending token too)."""
    return seq.num_tokens - seq.num_prompt_tokens < seq.sampling_params.min_tokens


def is_stop_token(seq: Sequence, token_id: int, eos_token_ids: frozenset[int]) -> bool:
    """eos (unless ignore_eos) or one of stop_token_ids, once min_tokens completion tokens
    are there (before, the sampler bans them, _banned_tokens: vLLM's rule)."""
    params = seq.sampling_params
    # Known tokens only (num_tokens may count one pending after token_id).
    if len(seq.token_ids) - seq.num_prompt_tokens < params.min_tokens:
        return False
    if not params.ignore_eos and token_id in eos_token_ids:
        return True
    return params.stop_token_ids is not None and token_id in params.stop_token_ids


def text_token_ids(token_ids: list[int], finish_reason: str | None,
                   stop_token_ids: list[int]) -> list[int]:
    """The completion tokens its text is decoded from: all but a stop token that ended it
    (SamplingParams.stop_token_ids: in token_ids, not in the text, as vLLM)."""
    if finish_reason == "stop" and token_ids and token_ids[-1] in stop_token_ids:
        return token_ids[:-1]
    return token_ids


def processes_logits(seq: Sequence) -> bool:
    """A control of process_logits acts on this row's logits this step."""
    return uses_penalties(seq) or bool(seq.sampling_params.logit_bias) or short_of_min_tokens(seq)


def uses_sampling_controls(seq: Sequence) -> bool:
    """Anything of this module for this row this step (min_p acts inside the Sampler)."""
    return processes_logits(seq) or seq.sampling_params.min_p > 0


def prepare_min_ps(seqs: list[Sequence], to_device: ToDevice) -> torch.Tensor | None:
    if not any(seq.sampling_params.min_p > 0 for seq in seqs):
        return None
    return to_device([seq.sampling_params.min_p for seq in seqs], torch.float32)


def prepare_logits_processing(seqs: list[Sequence], to_device: ToDevice,
                              pool_tokens: torch.Tensor, eos_token_ids: frozenset[int]
                              ) -> LogitsProcessing | None:
    """The step's LogitsProcessing, or None when no row asks for any of it.

    pool_tokens: the sampled-token pool, read for pending tokens before this step's forward.
    """
    if not any(processes_logits(seq) for seq in seqs):
        return None
    return LogitsProcessing(logit_bias=_logit_bias(seqs, to_device),
                            banned=_banned_tokens(seqs, to_device, eos_token_ids),
                            penalties=_penalties(seqs, to_device, pool_tokens))


def _logit_bias(seqs: list[Sequence], to_device: ToDevice) -> LogitBias | None:
    rows: list[int] = []
    token_ids: list[int] = []
    values: list[float] = []
    for row, seq in enumerate(seqs):
        bias = seq.sampling_params.logit_bias
        if bias:
            rows += [row] * len(bias)
            token_ids += bias.keys()
            values += bias.values()
    if not rows:
        return None
    return LogitBias(to_device(rows, torch.int64), to_device(token_ids, torch.int64),
                     to_device(values, torch.float32))


def _banned_tokens(seqs: list[Sequence], to_device: ToDevice, eos_token_ids: frozenset[int]
                   ) -> BannedTokens | None:
    """min_tokens: eos (even with ignore_eos, as vLLM) and stop_token_ids, while short."""
    rows: list[int] = []
    token_ids: list[int] = []
    for row, seq in enumerate(seqs):
        if short_of_min_tokens(seq):
            stops = eos_token_ids | set(seq.sampling_params.stop_token_ids or ())
            rows += [row] * len(stops)
            token_ids += sorted(stops)
    if not rows:
        return None
    return BannedTokens(to_device(rows, torch.int64), to_device(token_ids, torch.int64))


def _penalties(seqs: list[Sequence], to_device: ToDevice, pool_tokens: torch.Tensor
               ) -> Penalties | None:
    penalised = [row for row, seq in enumerate(seqs) if uses_penalties(seq)]
    if not penalised:
        return None
    params = [seqs[row].sampling_params for row in penalised]
    output_rows: list[int] = []
    output_ids: list[int] = []
    pending_rows: list[int] = []  # index into penalised, one per pending token
    pending_pool_rows: list[int] = []  # where that token is in the pool
    prompt_ids: list[torch.Tensor] = []
    for i, row in enumerate(penalised):
        seq = seqs[row]
        completion = seq.completion_token_ids
        output_rows += [i] * len(completion)
        output_ids += completion
        if seq.num_pending_tokens:
            # At most one: a step's tokens are read before the step after next is planned.
            assert seq.num_pending_tokens == 1 and seq.sampled_row is not None
            pending_rows.append(i)
            pending_pool_rows.append(seq.sampled_row)
        prompt_ids.append(_distinct_prompt_ids(seq, to_device)
                          if seq.sampling_params.repetition_penalty != 1
                          else to_device([], torch.int64))
    output_token_ids = to_device(output_ids, torch.int64)
    output_rows_t = to_device(output_rows, torch.int64)
    if pending_rows:
        pending = pool_tokens[to_device(pending_pool_rows, torch.int64)]
        output_token_ids = torch.cat([output_token_ids, pending])
        output_rows_t = torch.cat([output_rows_t, to_device(pending_rows, torch.int64)])
    # On the host, from the lengths (host metadata): a device repeat_interleave would read its
    # output size from the device.
    prompt_rows = to_device(np.repeat(np.arange(len(penalised)),
                                      [ids.numel() for ids in prompt_ids]), torch.int64)
    return Penalties(
        rows=to_device(penalised, torch.int64),
        presence=to_device([p.presence_penalty for p in params], torch.float32),
        frequency=to_device([p.frequency_penalty for p in params], torch.float32),
        repetition=to_device([p.repetition_penalty for p in params], torch.float32),
        output_rows=output_rows_t, output_token_ids=output_token_ids,
        prompt_rows=prompt_rows, prompt_token_ids=torch.cat(prompt_ids))


def _distinct_prompt_ids(seq: Sequence, to_device: ToDevice) -> torch.Tensor:
    """The prompt's distinct token ids on the device, made once per sequence (a prompt never
    changes; a copy per step would cost O(prompt length) of host time each step)."""
    extras = extras_of(seq)
    if extras.penalty_prompt_ids is None:
        extras.penalty_prompt_ids = to_device(sorted(set(seq.prompt_token_ids)), torch.int64)
    return extras.penalty_prompt_ids
