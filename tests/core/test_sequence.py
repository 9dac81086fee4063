"""Sequence: token bookkeeping, block layout, and the small pickle sent to TP workers."""

import pickle
from multiprocessing.reduction import ForkingPickler

import pytest

from myvllm.engine.sequence import Sequence, SequenceStatus
from myvllm.executor import sequence_pickling
from myvllm.sampling_parameters import SamplingParams
from myvllm.worker.pending_tokens import add_pending_token


def test_basic_fields_and_copy() -> None:
    prompt = [5, 6, 7]
    s = Sequence(prompt, 4)
    prompt.append(99)  # the caller's list is not ours
    assert s.token_ids == [5, 6, 7] and len(s) == 3
    assert s.status == SequenceStatus.WAITING and not s.is_finished
    assert s.last_token == 7 and s.num_prompt_tokens == 3 and s.num_completion_tokens == 0
    assert s.num_cached_tokens == 0 and s.block_table == []
    assert s.sampling_params == SamplingParams()
    s.append_token(8)
    assert s.last_token == 8 and s.num_tokens == 4 and s.num_completion_tokens == 1
    assert s.prompt_token_ids == [5, 6, 7] and s.completion_token_ids == [8]


def test_seq_ids_are_unique_and_increasing() -> None:
    a, b = Sequence([1], 4), Sequence([1], 4)
    assert b.seq_id > a.seq_id


@pytest.mark.parametrize("n, block_size, num_blocks, last", [
    (1, 4, 1, 1), (4, 4, 1, 4), (5, 4, 2, 1), (10, 4, 3, 2), (3, 1, 3, 1), (16, 16, 1, 16)])
def test_block_layout(n: int, block_size: int, num_blocks: int, last: int) -> None:
    s = Sequence(list(range(n)), block_size)
    assert s.num_blocks == num_blocks and s.last_block_num_tokens == last
    assert s.block(num_blocks - 1) == list(range((num_blocks - 1) * block_size, n))
    assert sum((s.block(i) for i in range(num_blocks)), []) == list(range(n))
    with pytest.raises(IndexError):
        s.block(num_blocks)


def worker_copy_of(seq: Sequence) -> Sequence:
    """seq as a tensor-parallel worker receives it: pickled by multiprocessing's pickler,
    with which the Executor registers the worker copy (executor/sequence_pickling.py)."""
    sequence_pickling.register()
    copy: Sequence = pickle.loads(ForkingPickler.dumps(seq))
    return copy


def test_bad_inputs() -> None:
    with pytest.raises(ValueError, match="Sequence.block_size=0: allowed: an int >= 1"):
        Sequence([1], 0)
    with pytest.raises(TypeError):
        Sequence([1.5], 4)
    with pytest.raises(ValueError, match=r"token_ids\[1\]=-1: allowed: token ids >= 0"):
        Sequence([3, -1], 4)


def test_pickle_before_first_token_carries_all_tokens() -> None:
    s = Sequence(list(range(9)), 4, SamplingParams(temperature=0.5))
    s.block_table, s.num_cached_tokens = [3, 1, 2], 4
    w = worker_copy_of(s)
    assert (w.seq_id, w.num_tokens, w.num_prompt_tokens, w.num_cached_tokens, w.block_table) == (
        s.seq_id, 9, 9, 4, [3, 1, 2])
    assert w.token_ids == s.token_ids and w.last_token == 8
    assert w.token_ids[w.num_cached_tokens:] == [4, 5, 6, 7, 8]
    assert w.num_blocks == 3 and w.last_block_num_tokens == 1


def test_pickle_in_decode_is_small_and_carries_last_token_only() -> None:
    s = Sequence(list(range(2000)), 16)
    s.block_table = list(range(126))
    s.status = SequenceStatus.RUNNING  # scheduled: its prefill ran and sampled a token
    full = len(ForkingPickler.dumps(s))
    s.append_token(7)
    w = worker_copy_of(s)
    assert len(ForkingPickler.dumps(s)) < full / 10
    assert w.last_token == 7 and len(w) == 2001 and w.num_prompt_tokens == 2000
    assert w.block_table == s.block_table and w.last_block_num_tokens == 1
    with pytest.raises(AttributeError):
        w.token_ids  # noqa: B018 -- a worker must never read stale token ids


def test_pickle_after_preemption_carries_all_tokens_again() -> None:
    # A preempted sequence is re-prefilled over prompt + completion: workers need them all.
    s = Sequence([1, 2, 3], 4)
    s.status = SequenceStatus.RUNNING
    s.append_token(4)
    s.append_token(5)
    assert not s.needs_prefill
    s.reset_for_recompute()  # what Scheduler.preempt does
    w = worker_copy_of(s)
    assert w.token_ids == [1, 2, 3, 4, 5] and w.num_prompt_tokens == 3


def test_pickle_with_a_pending_token_carries_its_row_of_the_pool() -> None:
    # Async scheduling under tensor parallelism: the token is still on the device, so the
    # worker gets where to read it (its row of the sampled-token pool), not its value.
    s = Sequence([1, 2, 3], 4)
    s.status = SequenceStatus.RUNNING
    s.append_token(4)
    s.sampled_row = 5
    add_pending_token(s)
    w = worker_copy_of(s)
    assert (w.num_pending_tokens, w.sampled_row, len(w)) == (1, 5, 5)
    assert w.last_block_num_tokens == 1  # the pending token's slot: the next block's first
    s.append_token(9)  # read back: nothing pending, the next message carries the token
    w = worker_copy_of(s)
    assert (w.num_pending_tokens, w.sampled_row, w.last_token, len(w)) == (0, None, 9, 5)


def test_a_plain_request_has_no_extras() -> None:
    # Temperature, top-k, top-p, max_tokens and ignore_eos are the plain path's own.
    for params in (None, SamplingParams(temperature=0.7, top_k=5, top_p=0.9, max_tokens=3,
                                        ignore_eos=True)):
        assert Sequence([1, 2, 3], 4, params).extras is None


@pytest.mark.parametrize("params", [
    SamplingParams(n=2), SamplingParams(seed=3), SamplingParams(logprobs=0),
    SamplingParams(prompt_logprobs=1), SamplingParams(repetition_penalty=1.2),
    SamplingParams(presence_penalty=0.5), SamplingParams(frequency_penalty=-0.5),
    SamplingParams(min_p=0.1), SamplingParams(logit_bias={1: 2.0}),
    SamplingParams(min_tokens=1), SamplingParams(stop_token_ids=[7]),
])
def test_a_request_that_asks_for_a_feature_has_extras(params: SamplingParams) -> None:
    extras = Sequence([1, 2, 3], 4, params).extras
    assert extras is not None
    assert extras.needs_prompt_logprobs == (params.prompt_logprobs is not None)
    assert (extras.prompt_logprobs is not None) == (params.prompt_logprobs is not None)
    assert (extras.generator, extras.grammar_matcher, extras.forks, extras.fork_source,
            extras.spec_token_ids) == (None, None, [], None, [])


def test_extras_of_makes_them_later() -> None:
    from myvllm.sample.extras import extras_of, proposals_of

    s = Sequence([1, 2, 3], 4)
    assert proposals_of(s) == [] and s.extras is None
    extras_of(s).spec_token_ids = [5, 6]
    assert s.extras is not None and proposals_of(s) == [5, 6]
    assert extras_of(s) is s.extras


def test_the_grammar_matcher_sees_every_appended_token() -> None:
    class Matcher:
        over_budget = False

        def __init__(self) -> None:
            self.seen: list[int] = []

        def accept_token(self, token_id: int) -> bool:
            self.seen.append(token_id)
            return token_id != 13

    s = Sequence([1, 2], 4, SamplingParams(seed=0))
    assert s.extras is not None
    s.extras.grammar_matcher = matcher = Matcher()
    s.append_token(5)
    assert matcher.seen == [5] and s.token_ids == [1, 2, 5]
    with pytest.raises(RuntimeError, match="grammar does not accept"):
        s.append_token(13)


def test_pickle_keeps_only_what_a_worker_reads_of_the_extras() -> None:
    plain = worker_copy_of(Sequence([1, 2, 3], 4))
    assert plain.extras is None and plain.status == SequenceStatus.RUNNING
    s = Sequence([1, 2, 3], 4, SamplingParams(seed=1, n=2))  # nothing a worker reads
    assert s.extras is not None
    assert worker_copy_of(s).extras is None
    s.extras.spec_token_ids = [8, 9]
    w = worker_copy_of(s)
    assert w.extras.spec_token_ids == [8, 9] and not w.extras.needs_prompt_logprobs
    assert w.extras.generator is None and w.extras.prompt_logprobs is None
    s = Sequence([1, 2, 3], 4, SamplingParams(prompt_logprobs=2))
    w = worker_copy_of(s)
    assert w.extras.needs_prompt_logprobs and w.extras.prompt_logprobs is None


def test_importing_the_sequence_loads_no_feature_module() -> None:
    import subprocess
    import sys

    code = ("import sys, myvllm.engine.sequence\n"
            "bad = [m for m in ('torch', 'msgspec', 'myvllm.sample.extras') if m in sys.modules]\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_preempted_sequence_keeps_nothing_of_its_last_run() -> None:
    """reset_for_recompute (a recompute preemption): the sequence waits again with nothing
    cached or computed, its next forward a prefill over all its tokens, no speculative
    proposals left (their K/V is gone with its blocks), and each preemption counted (a draft
    model's K/V of it is gone too: spec_decode/draft_proposer.py)."""
    s = Sequence([1, 2, 3, 4, 5], 4, SamplingParams(seed=1))  # a seed: it has extras
    assert s.extras is not None
    for preemption in (1, 2):
        s.status = SequenceStatus.RUNNING
        s.num_cached_tokens, s.num_computed_tokens = 4, len(s)
        s.append_token(6 + preemption)
        s.extras.spec_token_ids = [7, 8]
        s.reset_for_recompute()
        assert s.status == SequenceStatus.WAITING and s.needs_prefill
        assert (s.num_cached_tokens, s.num_computed_tokens) == (0, 0)
        assert s.extras.spec_token_ids == [] and s.num_preemptions == preemption
    assert s.token_ids == [1, 2, 3, 4, 5, 7, 8]  # its tokens stay: they are computed again
