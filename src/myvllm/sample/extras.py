"""SequenceExtras: a Sequence's state for the optional features, in its one field
``Sequence.extras``, which is None for a plain request.

A Sequence makes them when its SamplingParams asks for a feature (asks_for_extras, in
engine/sequence.py); a feature that needs them later (the speculator's proposals, a fork of
an n > 1 request) makes them with extras_of. Each feature reads and writes its own fields
here; all of it is rank 0's (a tensor-parallel worker's copy keeps only what its forward
reads: executor/sequence_pickling.py) and ends with the request. And LogprobsLists, the
logprobs of a request's tokens as every layer above passes them on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

import msgspec

if TYPE_CHECKING:
    import torch


class LogprobsLists(msgspec.Struct, array_like=True):
    """Logprobs of consecutive tokens of one request, one entry per token (vLLM's name): in
    the Sequence's extras, its RequestOutputs and, over the socket, CoreOutputs
    (serving/core_messages.py).

    logprobs[i] is token i's own; top_token_ids[i] / top_logprobs[i] its most likely
    alternatives, most likely first (as many as the request asked for)."""

    logprobs: list[float]
    top_token_ids: list[list[int]]
    top_logprobs: list[list[float]]

    def __len__(self) -> int:
        return len(self.logprobs)

    def slice(self, start: int, end: int) -> LogprobsLists:
        return LogprobsLists(self.logprobs[start:end], self.top_token_ids[start:end],
                             self.top_logprobs[start:end])

    def extend(self, other: LogprobsLists) -> None:
        self.logprobs += other.logprobs
        self.top_token_ids += other.top_token_ids
        self.top_logprobs += other.top_logprobs


# The Sequence that holds them (forks are Sequences too): a type parameter, since the
# Sequence's module makes them and this one does not import it.
SeqT = TypeVar("SeqT")


class SequenceExtras(Generic[SeqT]):
    def __init__(self, needs_prompt_logprobs: bool = False) -> None:
        # Prompt logprobs still to compute (sample/logprobs.py): the prefill's LM head runs
        # over the prompt rows too (on every rank), and reads no prefix-cache hit (a cached
        # token has no logits). Cleared once all of them reached the host; the ones read back
        # so far wait in prompt_logprobs until an output carries them away.
        self.needs_prompt_logprobs: bool = needs_prompt_logprobs
        self.prompt_logprobs: LogprobsLists | None = (
            LogprobsLists([], [], []) if needs_prompt_logprobs else None)
        # The seeded generator, made at the first sampled step (sample/sampling_controls.py).
        self.generator: torch.Generator | None = None
        # The prompt's distinct ids for repetition_penalty (sample/sampling_controls.py).
        self.penalty_prompt_ids: torch.Tensor | None = None
        # The grammar's matcher (structured_output/matchers.py), and whether the step
        # budget ended it (structured_output/step_budget.py: the scheduler then ends the
        # request).
        self.grammar_matcher: Any = None
        self.grammar_too_slow = False
        # SamplingParams.n > 1 (sample/forks.py): the request's other completions, held by
        # its first until the first's last prompt chunk is scheduled, and, for those, the
        # first.
        self.forks: list[SeqT] = []
        self.fork_source: SeqT | None = None
        # Speculative decoding: the tokens proposed after the last one for the step being
        # scheduled; never in token_ids (spec_decode/scheduling.py).
        self.spec_token_ids: list[int] = []

    def advance_grammar(self, seq_id: int, token_id: int) -> None:
        """Advance the grammar's matcher past a sampled token."""
        if not self.grammar_matcher.accept_token(token_id):
            # The sampler only picks tokens the matcher's bitmask allowed, so this is a bug.
            raise RuntimeError(f"sequence {seq_id}: token {token_id} was sampled but its "
                               "grammar does not accept it")
        self.grammar_too_slow = self.grammar_matcher.over_budget


class HoldsExtras(Protocol):
    """A Sequence, as far as extras_of is concerned."""

    extras: SequenceExtras[Any] | None


def extras_of(seq: HoldsExtras) -> SequenceExtras[Any]:
    """seq's extras, made now if it has none (a feature that needs them after the
    Sequence was made)."""
    if seq.extras is None:
        seq.extras = SequenceExtras()
    return seq.extras


def proposals_of(seq: HoldsExtras) -> list[int]:
    """seq's speculative proposals for the step being scheduled (the list itself; [] without
    extras)."""
    return seq.extras.spec_token_ids if seq.extras is not None else []
