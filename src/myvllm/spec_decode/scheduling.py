"""The scheduler's side of speculative decoding: proposals for a decode row, and what the
accepted count does to the sequence afterwards.

Scheduling a decode row with proposals d_1..d_k (n = the sequence's tokens, t_n its last):

    extras.spec_token_ids = [d_1 .. d_k]        never in token_ids until accepted
    num_new_tokens      = 1 + k                 t_n and the proposals, one forward pass
    num_computed_tokens = n + k                 K/V written up to position n + k - 1
    blocks              for n + k positions     BlockManager.append(seq, num_lookahead=k)

After the step (Scheduler.postprocess hands the row to Speculator.postprocess_row) the row
emits a accepted proposals and one token of the target's (1 <= a + 1 <= k + 1); each is
appended and checked for a stop as if decoded one by one (tokens after a stop are dropped).
Then the sequence rolls back to what holds:

    num_tokens          = n + a + 1
    num_computed_tokens = n + a                 positions whose K/V came from accepted
                                                inputs (t_n, d_1 .. d_a); the slots of the
                                                rejected proposals are overwritten later
    blocks              past the ones n + a + 1 tokens occupy are released (they held only
                        rejected proposals: free_lookahead_blocks); none was registered
                        for prefix hits, since registration reads token_ids, where
                        proposals never are

Proposals never cost another sequence its place: a row whose lookahead blocks do not fit,
or whose budget is spent, decodes plainly. They are cut so that even all accepted, the row
stays within max_tokens and max_model_length (a + 1 <= what is left).

Back-off: a verification row costs more than a decode row (k + 1 positions through the
prefill path instead of one through the decode graph), so proposals that are mostly
rejected make decoding slower, not faster; and a row that looks up proposals needs its
tokens on the host, so with async scheduling its step is read back before the next is
planned (EngineCore.step), which costs the overlap even when the lookup finds nothing. So a
verification that accepts fewer than half of its proposals is a miss, and so is a lookup
that finds nothing; after m misses in a row the sequence skips the lookup for its next
2**m decode steps (at most MAX_SKIPPED_STEPS), and a verification that accepts at least
half resets m. Free text then soon decodes plainly, overlapped, and tries again now and
then; copying text rarely misses. (vLLM turns speculation off above a batch size instead;
this rule is per sequence.) Which tokens come out never depends on it: only which steps
verify. The back-off is prompt lookup's: a draft model proposes at every decode step.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from myvllm.config import Config
from myvllm.engine.sequence import Sequence
from myvllm.sample.extras import extras_of
from myvllm.sample.sampling_controls import uses_sampling_controls
from myvllm.spec_decode.ngram_proposer import NgramIndex, NgramProposer
from myvllm.spec_decode.stats import SpecDecodeStats
from myvllm.value_checks import refusal

if TYPE_CHECKING:
    from myvllm.engine.block_manager import BlockManager

MAX_MISSES = 6
MAX_SKIPPED_STEPS = 2**MAX_MISSES  # decode steps a sequence skips the lookup, at most
DRAFT_SLOT = 0  # a proposal slot the draft model has not filled yet


@dataclass
class SequenceSpecState:
    """What the Speculator keeps per sequence: its n-gram index and its back-off."""

    index: NgramIndex
    # misses in a row: verifications that accepted fewer than half, lookups that found none
    misses: int = 0
    steps_to_skip: int = 0  # decode steps left without a lookup


class Speculator:
    def __init__(self, config: Config) -> None:
        if config.speculative_method not in ("ngram", "draft"):
            raise refusal("Config.speculative_method", config.speculative_method,
                          "'ngram' or 'draft' (a method with a proposer)")
        self.num_speculative_tokens = config.num_speculative_tokens
        # A draft model's proposals are made by the model runner, just before the step
        # that verifies them (spec_decode/draft_proposer.py): here the row only gets its
        # slots, DRAFT_SLOT each, and the blocks they need.
        self.proposer: NgramProposer | None = (
            NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
            if config.speculative_method == "ngram" else None)
        self.stats = SpecDecodeStats()
        # Dropped with the sequence (no finish hook needed).
        self.states: weakref.WeakKeyDictionary[Sequence, SequenceSpecState] = (
            weakref.WeakKeyDictionary())

    def state(self, seq: Sequence) -> SequenceSpecState:
        state = self.states.get(seq)
        if state is None:
            assert isinstance(self.proposer, NgramProposer), "prompt lookup's state only"
            state = self.states[seq] = SequenceSpecState(self.proposer.new_index())
        return state

    @staticmethod
    def may_propose(seq: Sequence) -> bool:
        # Per-token logprobs, the logits processing of penalties, logit_bias, min_tokens
        # and min_p, and a grammar's bitmask come from the one-token path; verification
        # samples from the plain target distribution.
        return (seq.sampling_params.logprobs is None and not uses_sampling_controls(seq)
                and (seq.extras is None or seq.extras.grammar_matcher is None))

    def needs_tokens_on_host(self, seq: Sequence) -> bool:
        """Must the step just queued for seq be read back before the next one is planned?
        Yes if seq verifies proposals in it, or will look up proposals in the next."""
        if seq.extras is not None and seq.extras.spec_token_ids:
            return True
        if not self.may_propose(seq):
            return False
        state = self.states.get(seq)
        return (not isinstance(self.proposer, NgramProposer) or state is None
                or state.steps_to_skip == 0)  # a draft model needs them at every step

    def propose(self, seq: Sequence, max_model_length: int, budget: int) -> list[int]:
        """Proposals for seq's next decode row; budget: the step's tokens left, the row's
        own included."""
        if not self.may_propose(seq):
            return []
        # A stand-in proposer (tests) has no index and no back-off.
        state = self.state(seq) if isinstance(self.proposer, NgramProposer) else None
        if state is not None and state.steps_to_skip:
            state.steps_to_skip -= 1  # a decode step, overlapped or not
            return []
        if seq.num_pending_tokens:
            return []  # its last token is not on the host yet (async scheduling)
        left = min(seq.sampling_params.max_tokens - seq.num_completion_tokens,
                   max_model_length - seq.num_tokens)
        limit = min(self.num_speculative_tokens, left - 1, budget - 1)
        if limit <= 0:
            return []
        if self.proposer is None:
            return [DRAFT_SLOT] * limit  # the draft model fills them (see __init__)
        if state is None:
            return self.proposer.propose(seq.token_ids, limit)
        proposals = state.index.propose(seq.token_ids, limit)
        if not proposals:
            self._missed(state)
        return proposals

    def observe(self, seq: Sequence, num_draft_tokens: int, num_accepted: int) -> None:
        """A verification row of seq: counted for /metrics, and its back-off updated."""
        self.stats.observe(num_draft_tokens, num_accepted)
        state = self.states.get(seq)
        if state is None:
            return
        if 2 * num_accepted < num_draft_tokens:
            self._missed(state)
        else:
            state.misses = 0

    @staticmethod
    def carried_proposals(seq: Sequence) -> bool:
        """Did seq's row carry proposals in the step just read back (a verification row)?"""
        return seq.extras is not None and bool(seq.extras.spec_token_ids)

    def postprocess_row(self, seq: Sequence, verified: dict[int, list[int]] | None, row: int,
                        append_and_check_stop: Callable[[Sequence, int], None],
                        block_manager: BlockManager) -> None:
        """seq's verification row read back (the step's row-th sampled row): the tokens it
        emitted appended one by one, each checked for a stop as if decoded alone
        (append_and_check_stop, the Scheduler's; tokens after a stop are dropped), then,
        unless it finished, seq rolled back to what holds."""
        for token in verified_tokens(self, seq, take_proposals(seq), verified, row):
            append_and_check_stop(seq, token)
            if seq.is_finished:
                return
        roll_back(block_manager, seq)

    @staticmethod
    def _missed(state: SequenceSpecState) -> None:
        state.misses = min(state.misses + 1, MAX_MISSES)
        state.steps_to_skip = 2**state.misses


def make_speculator(config: Config) -> Speculator | None:
    return Speculator(config) if config.speculative_method is not None else None


# ---------------------------------------------------------------- the Scheduler's calls
def proposals_for_row(speculator: Speculator, block_manager: BlockManager,
                      seq: Sequence, max_model_length: int, budget: int) -> list[int]:
    """The proposals seq's decode row carries in the step being scheduled: none if their
    lookahead blocks do not fit (proposals never preempt: the row decodes plainly)."""
    proposals = speculator.propose(seq, max_model_length, budget)
    if proposals and not block_manager.can_append(seq, num_lookahead=len(proposals)):
        return []
    return proposals


def propose_for_row(speculator: Speculator, block_manager: BlockManager, seq: Sequence,
                    max_model_length: int, budget: int) -> int:
    """How many proposals seq's decode row carries in the step being scheduled
    (proposals_for_row), kept in its extras for the step (a preemption of seq drops them)."""
    proposals = proposals_for_row(speculator, block_manager, seq, max_model_length, budget)
    if proposals:
        extras_of(seq).spec_token_ids = proposals
    return len(proposals)


def take_proposals(seq: Sequence) -> list[int]:
    """The proposals seq's row carried in the step just read back; none is left on it."""
    if seq.extras is None:
        return []
    proposals, seq.extras.spec_token_ids = seq.extras.spec_token_ids, []
    return proposals


def verified_tokens(speculator: Speculator, seq: Sequence, proposals: list[int],
                    verified: dict[int, list[int]] | None, row: int) -> list[int]:
    """The tokens seq's verification row (the step's row-th sampled row) emitted: its
    accepted proposals, then one of the target's; counted for /metrics and the back-off."""
    if verified is None or row not in verified:
        raise ValueError(f"sequence {seq.seq_id} verified proposals but "
                         "postprocess got no tokens for them")
    speculator.observe(seq, len(proposals), len(verified[row]) - 1)
    return verified[row]


def roll_back(block_manager: BlockManager, seq: Sequence) -> None:
    """After its verification row (seq not finished): the K/V of t_n and the accepted
    proposals holds, the rejected ones' blocks go (their slots in kept blocks are
    rewritten)."""
    seq.num_computed_tokens = seq.num_tokens - 1
    free_lookahead_blocks(block_manager, seq)


def free_lookahead_blocks(block_manager: BlockManager, seq: Sequence) -> None:
    """Release the blocks past the ones seq's tokens occupy: after a verification step, the
    blocks that held only rejected proposals (never registered: fresh blocks)."""
    while len(seq.block_table) > seq.num_blocks:
        block_manager.release_block(seq.block_table.pop())
