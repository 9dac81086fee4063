"""Prompt lookup: the incremental NgramIndex the engine uses proposes what the full scan of
NgramProposer.propose (the definition) proposes, at every length of a growing sequence; and
the back-off stops the lookups of a sequence whose proposals keep failing, without changing
its tokens."""

from __future__ import annotations

import os

import pytest
from helpers_models import tiny_checkpoint
from hypothesis import given, settings
from hypothesis import strategies as st

from myvllm import LLM, SamplingParams
from myvllm.spec_decode.ngram_proposer import NgramProposer
from myvllm.spec_decode.scheduling import MAX_SKIPPED_STEPS

EXAMPLES = settings(max_examples=int(os.environ.get("MYVLLM_HYPOTHESIS_EXAMPLES", "100")),
                    deadline=None)


@EXAMPLES
@given(tokens=st.lists(st.integers(0, 3), max_size=80), lookup=st.sampled_from(
    [(1, 1), (1, 3), (2, 4), (3, 5)]), max_tokens=st.integers(0, 6),
    growth=st.lists(st.integers(1, 9), min_size=1, max_size=20))
def test_incremental_index_proposes_what_the_full_scan_proposes(
        tokens: list[int], lookup: tuple[int, int], max_tokens: int, growth: list[int]) -> None:
    proposer = NgramProposer(*lookup)
    index = proposer.new_index()
    # The sequence grows by a few tokens between calls (an accepted run, or one token),
    # the same list object as a Sequence's token_ids.
    sequence: list[int] = []
    at = 0
    for step in growth:
        sequence.extend(tokens[at:at + step])
        at += step
        assert index.propose(sequence, max_tokens) == proposer.propose(sequence, max_tokens)
        if at >= len(tokens):
            break


def test_first_occurrence_and_longest_match_win() -> None:
    proposer = NgramProposer(1, 3)
    tokens = [1, 2, 3, 9, 2, 3, 8, 1, 2, 3]  # suffix 1 2 3 first ends at 2
    for propose in (proposer.propose, proposer.new_index().propose):
        assert propose(tokens, 2) == [9, 2]
        assert propose([4, 5, 6], 3) == []  # nothing earlier matches


class WrongLookup(NgramProposer):
    """Proposes tokens the model will not produce (its greedy continuation, shifted); the
    index of every sequence is itself."""

    def __init__(self, continuation: list[int], vocab: int) -> None:
        super().__init__(1, 1)
        self.continuation, self.vocab = continuation, vocab

    def new_index(self) -> WrongLookup:  # type: ignore[override]
        return self

    def propose(self, token_ids: list[int], max_tokens: int) -> list[int]:
        right = self.continuation[len(token_ids):len(token_ids) + max_tokens]
        return [(t + 1) % self.vocab for t in right]


@pytest.mark.slow
def test_a_sequence_whose_proposals_fail_stops_proposing() -> None:
    """Every proposal rejected: the lookups back off (2, 4, 8, ... steps skipped), so only a
    handful of the 200 decode steps verify; the tokens are plain decoding's."""
    path = str(tiny_checkpoint("qwen3"))
    common = dict(max_model_length=256, num_kvcache_blocks=64)
    prompt = [3, 141, 59, 26, 53, 58, 97, 93, 23, 84]
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    expected = LLM(path, **common).generate([prompt], params, use_tqdm=False)[0]["token_ids"]
    llm = LLM(path, **common, speculative_method="ngram", num_speculative_tokens=3)
    speculator = llm.engine_core.scheduler.speculator
    assert speculator is not None
    speculator.proposer = WrongLookup(prompt + expected, llm.vocab_size)
    assert llm.generate([prompt], params, use_tqdm=False)[0]["token_ids"] == expected
    stats = speculator.stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens == 0
    # Misses 1..6 skip 2 + 4 + ... + 64 = 126 steps, then 64 each: 7 or 8 verifications.
    assert 6 <= stats.num_drafts <= 6 + 200 // MAX_SKIPPED_STEPS + 1
