"""Scheduler: its four rules, a probe per rule, and the cases where a scheduler goes wrong
(a sequence dropped, a step that makes no progress, a sequence that can never fit).

No model here: tests call schedule() and postprocess() with made-up token ids, the way the
LLMEngine does around ModelRunner.run().
"""

from __future__ import annotations

import pytest

from myvllm.config import Config
from myvllm.engine.scheduler import Scheduler
from myvllm.engine.sequence import Sequence, SequenceStatus
from myvllm.sampling_parameters import SamplingParams
from helpers_blocks import used_block_ids

PREFIX = [10, 20, 30, 40, 50, 60, 70, 80]


def make(num_blocks: int = 16, block_size: int = 4, **kw: object) -> Scheduler:
    kw.setdefault("max_model_length", 256)
    kw.setdefault("eos", -1)
    kw.setdefault("enable_chunked_prefill", False)  # the prefill-first rules tested here
    return Scheduler(Config(num_kvcache_blocks=num_blocks, block_size=block_size, **kw))


def seq(tokens: list[int], block_size: int = 4, max_tokens: int = 16, **kw: object) -> Sequence:
    return Sequence(tokens, block_size, SamplingParams(max_tokens=max_tokens, **kw))


def ids(seqs: list[Sequence]) -> list[int]:
    return [s.seq_id for s in seqs]


# ---------------------------------------------------------------- probes of the rules
def test_three_sequences_share_a_prefix() -> None:
    sch = make()
    a, b, c = (seq(PREFIX + [i]) for i in (1, 2, 3))
    sch.add_sequence(a)
    assert sch.schedule() == ([a], True)
    sch.add_sequence(b)
    sch.add_sequence(c)
    assert sch.schedule() == ([b, c], True)
    assert (a.block_table, b.block_table, c.block_table) == ([0, 1, 2], [0, 1, 3], [0, 1, 4])
    refs = {i: sch.block_manager.blocks[i].ref_count for i in range(5)}
    assert refs == {0: 3, 1: 3, 2: 1, 3: 1, 4: 1}
    assert (a.num_cached_tokens, b.num_cached_tokens, c.num_cached_tokens) == (0, 8, 8)


def test_prefix_served_from_cache_after_first_request_finished() -> None:
    sch = make()
    a = seq(PREFIX + [1], max_tokens=1)
    sch.add_sequence(a)
    batch, _ = sch.schedule()
    sch.postprocess(batch, [99])
    assert a.is_finished and sch.is_finished() and not used_block_ids(sch.block_manager)
    b = seq(PREFIX + [2])
    sch.add_sequence(b)
    assert sch.schedule() == ([b], True)
    assert b.num_cached_tokens == 8 and b.block_table[:2] == [0, 1]


def test_fully_cached_prompt_still_computes_a_token() -> None:
    sch = make()
    a = seq(PREFIX, max_tokens=1)
    sch.add_sequence(a)
    sch.postprocess(sch.schedule()[0], [5])
    b = seq(PREFIX)
    sch.add_sequence(b)
    sch.schedule()
    assert b.num_cached_tokens == 4 and len(b) - b.num_cached_tokens == 4


def test_prefix_caching_disabled_by_config() -> None:
    sch = make(enable_prefix_caching=False)
    a, b = seq(PREFIX + [1]), seq(PREFIX + [2])
    sch.add_sequence(a)
    sch.add_sequence(b)
    sch.schedule()
    assert b.num_cached_tokens == 0 and b.block_table == [3, 4, 5]


# ---------------------------------------------------------------- rule 1: prefill first
def test_prefill_first_skips_running_decode() -> None:
    sch = make()
    a = seq([1, 2, 3])
    sch.add_sequence(a)
    assert sch.schedule() == ([a], True)
    sch.postprocess([a], [4])
    b = seq([5, 6])
    sch.add_sequence(b)
    batch, is_prefill = sch.schedule()
    assert batch == [b] and is_prefill
    assert a.num_tokens == 4 and a.status == SequenceStatus.RUNNING
    sch.postprocess(batch, [7])
    batch, is_prefill = sch.schedule()
    assert batch == [a, b] and not is_prefill  # decode in running (admission) order


# ---------------------------------------------------------------- rule 2: batched, FIFO
def test_normal_path_batches_all_prefills_then_decodes() -> None:
    sch = make()
    seqs = [seq([i, i + 1, i + 2], max_tokens=2) for i in range(5)]
    for s in seqs:
        sch.add_sequence(s)
    batch, is_prefill = sch.schedule()
    assert batch == seqs and is_prefill and not sch.waiting
    sch.postprocess(batch, [1] * 5)
    batch, is_prefill = sch.schedule()
    assert batch == seqs and not is_prefill
    finished = sch.postprocess(batch, [2] * 5)
    assert finished == seqs and all(s.completion_token_ids == [1, 2] for s in seqs)
    assert sch.is_finished() and len(sch.block_manager.free_block_ids) == 16


def test_token_budget_keeps_the_rest_waiting() -> None:
    sch = make(max_num_batched_tokens=8)
    seqs = [seq([1, 2, 3, 4, 5, 6 + i], max_tokens=2) for i in range(4)]
    for s in seqs:
        sch.add_sequence(s)
    batch, is_prefill = sch.schedule()
    assert batch == seqs[:1] and is_prefill
    assert list(sch.waiting) == seqs[1:]  # kept, in order, nothing dropped
    assert all(s.status == SequenceStatus.WAITING and not s.block_table for s in seqs[1:])


def test_max_num_sequences_bounds_running() -> None:
    sch = make(max_num_sequences=2)
    seqs = [seq([i + 1]) for i in range(3)]
    for s in seqs:
        sch.add_sequence(s)
    assert sch.schedule() == (seqs[:2], True)
    sch.postprocess(seqs[:2], [0, 0])
    assert sch.schedule() == (seqs[:2], False)
    assert list(sch.waiting) == seqs[2:]


def test_head_that_does_not_fit_blocks_the_queue() -> None:
    sch = make(num_blocks=3)
    big, small = seq(list(range(1, 10)), max_tokens=2), seq([1], max_tokens=2)
    running = seq([5], max_tokens=8)
    sch.add_sequence(running)
    sch.schedule()
    sch.postprocess([running], [6])
    sch.add_sequence(big)  # needs 3 blocks, only 2 free
    sch.add_sequence(small)
    batch, is_prefill = sch.schedule()
    assert batch == [running] and not is_prefill
    assert list(sch.waiting) == [big, small]


# ---------------------------------------------------------------- rule 3: preemption
def test_tail_is_preempted_to_front_of_waiting() -> None:
    """Block pool of 2, two sequences each filling one block of 4, both need a new block."""
    sch = make(num_blocks=2, max_model_length=64)
    a, b = seq([1, 2, 3, 4], max_tokens=4), seq([5, 6, 7, 8], max_tokens=4)
    c = seq([9, 9, 9, 9], max_tokens=4)
    sch.add_sequence(a)
    sch.add_sequence(b)
    batch, _ = sch.schedule()
    assert batch == [a, b] and a.block_table == [0] and b.block_table == [1]
    sch.postprocess(batch, [11, 12])  # 5 tokens each: both need a second block
    sch.add_sequence(c)  # waits: no free block
    batch, is_prefill = sch.schedule()
    assert batch == [a] and not is_prefill
    assert list(sch.running) == [a] and list(sch.waiting) == [b, c]
    assert b.status == SequenceStatus.WAITING and b.block_table == []
    assert b.num_cached_tokens == 0 and b.needs_prefill
    assert b.completion_token_ids == [12]  # the preempted sequence keeps its tokens
    assert a.block_table == [0, 1]


def test_can_append_failure_keeps_every_sequence() -> None:
    sch = make(num_blocks=4, max_model_length=64)
    seqs = [seq([i] * 4, max_tokens=3) for i in range(1, 5)]
    for s in seqs:
        sch.add_sequence(s)
    sch.postprocess(sch.schedule()[0], [0] * 4)
    batch, _ = sch.schedule()
    # each needs a block and none is free: the tail gives its block to the head, and so on
    assert batch == seqs[:2] and list(sch.waiting) == [seqs[2], seqs[3]]  # order kept
    everyone = list(sch.running) + list(sch.waiting)
    assert sorted(ids(everyone)) == sorted(ids(seqs))


def test_preempted_sequence_finishes_with_all_its_tokens() -> None:
    sch = make(num_blocks=2, max_model_length=64)
    a, b = seq([1, 2, 3, 4], max_tokens=4), seq([5, 6, 7, 8], max_tokens=4)
    sch.add_sequence(a)
    sch.add_sequence(b)
    steps = 0
    while not sch.is_finished():
        batch, _ = sch.schedule()
        sch.postprocess(batch, [100 + len(s) for s in batch])  # token = f(position)
        steps += 1
        assert steps < 50
    for s in (a, b):
        assert s.completion_token_ids == [104, 105, 106, 107]
    assert len(sch.block_manager.free_block_ids) == 2


def test_preempt_called_directly_removes_from_running() -> None:
    sch = make()
    a, b = seq(PREFIX + [1]), seq(PREFIX + [2])
    sch.add_sequence(a)
    sch.add_sequence(b)
    sch.schedule()
    assert b.num_cached_tokens == 8
    sch.preempt(b)
    assert list(sch.running) == [a] and list(sch.waiting) == [b]
    assert b.block_table == [] and b.num_cached_tokens == 0
    assert sch.block_manager.blocks[0].ref_count == 1  # a still holds the shared prefix


def test_finished_sequence_keeps_its_cache_hit_count() -> None:
    sch = make()
    a, b = seq(PREFIX + [1], max_tokens=1), seq(PREFIX + [2], max_tokens=1)
    sch.add_sequence(a)
    sch.add_sequence(b)
    batch, _ = sch.schedule()
    assert sch.postprocess(batch, [5, 5]) == [a, b]
    assert b.block_table == [] and b.num_cached_tokens == 8


# ---------------------------------------------------------------- rule 4: no progress
def test_no_progress_raises_with_counts() -> None:
    sch = make(num_blocks=2)
    leaked = sch.block_manager._allocate_fresh_block()  # a block nobody will ever free
    assert leaked == 0
    sch.add_sequence(seq([1] * 8, max_tokens=1))  # needs both blocks
    with pytest.raises(RuntimeError, match=r"no progress: 1 waiting and 0 running .* 1 of 2 "
                                           r"blocks free.*cannot fit.*ref_count"):
        sch.schedule()


def test_no_progress_when_the_only_running_sequence_cannot_grow() -> None:
    sch = make(num_blocks=2)
    a = seq([1, 2, 3, 4], max_tokens=4)
    sch.add_sequence(a)
    sch.schedule()
    sch.block_manager._allocate_fresh_block()  # leak the last free block
    sch.postprocess([a], [5])
    with pytest.raises(RuntimeError, match="no progress"):
        sch.schedule()  # a preempts itself, then cannot be prefilled again
    assert list(sch.waiting) == [a]  # still not dropped


def test_schedule_when_idle() -> None:
    assert make().schedule() == ([], False)


# ---------------------------------------------------------------- add_sequence
@pytest.mark.parametrize("tokens, max_tokens, kw, message", [
    ([], 4, {}, "empty prompt"),
    (list(range(1, 18)), 4, {"max_model_length": 16},
     "prompt_tokens=17: allowed: at most 15 with max_model_length=16"),
    # A prompt of exactly max_model_length tokens leaves no room for its first token.
    (list(range(1, 17)), 4, {"max_model_length": 16}, "prompt_tokens=16: allowed: at most 15"),
    (list(range(1, 9)), 2, {"num_blocks": 2},
     r"9 tokens = 3 blocks of 4: allowed: at most the 2 blocks of the whole KV cache"),
    ([1], 16, {"num_blocks": 2}, r"16 tokens = 4 blocks"),
    ([1, 2, 3], 8, {"max_num_batched_tokens": 8},
     "10 tokens: allowed: at most max_num_batched_tokens=8 without chunked prefill"),
])
def test_add_sequence_rejects_before_queuing(tokens: list[int], max_tokens: int,
                                             kw: dict, message: str) -> None:
    sch = make(**kw)
    with pytest.raises(ValueError, match=message):
        sch.add_sequence(seq(tokens, max_tokens=max_tokens))
    assert not sch.waiting


def test_add_sequence_accepts_exact_fit_and_runs_it() -> None:
    # prompt 4 + 5 tokens: the 9th token is never written to the cache, 8 tokens = 2 blocks
    sch = make(num_blocks=2, max_num_batched_tokens=8)
    s = seq([1, 2, 3, 4], max_tokens=5)
    sch.add_sequence(s)
    while not sch.is_finished():
        sch.postprocess(sch.schedule()[0], [7])
    assert s.completion_token_ids == [7] * 5


def test_add_sequence_max_model_length_bounds_growth() -> None:
    sch = make(num_blocks=2, max_model_length=9)
    s = seq([1, 2, 3, 4], max_tokens=100)  # stops at 9 tokens: 8 in the cache
    sch.add_sequence(s)
    while not sch.is_finished():
        sch.postprocess(sch.schedule()[0], [7])
    assert len(s) == 9


def test_add_sequence_rejects_block_size_mismatch_and_reuse() -> None:
    sch = make(block_size=4)
    with pytest.raises(ValueError, match="block_size=8: allowed: 4, the KV cache's block size"):
        sch.add_sequence(seq([1], block_size=8))
    s = seq([1])
    sch.add_sequence(s)
    sch.schedule()
    with pytest.raises(ValueError, match="not a new request"):
        sch.add_sequence(s)


def test_scheduler_needs_sized_cache() -> None:
    with pytest.raises(ValueError, match="num_kvcache_blocks"):
        Scheduler(Config())


# ---------------------------------------------------------------- postprocess
def test_finish_conditions() -> None:
    sch = make(eos=(7, 8), max_model_length=6)
    on_eos = seq([1])
    ignore = seq([2], ignore_eos=True)
    by_max = seq([3], max_tokens=1)
    by_len = seq([1, 2, 3, 4, 5], max_tokens=10)
    for s in (on_eos, ignore, by_max, by_len):
        sch.add_sequence(s)
    batch, _ = sch.schedule()
    finished = sch.postprocess(batch, [8, 7, 1, 1])
    assert finished == [on_eos, by_max, by_len]
    assert list(sch.running) == [ignore] and ignore.status == SequenceStatus.RUNNING
    for s in finished:
        assert s.is_finished and s.block_table == []
    assert on_eos.completion_token_ids == [8]


def test_eos_minus_one_means_no_eos() -> None:
    sch = make(eos=-1)
    s = seq([1], max_tokens=2)
    sch.add_sequence(s)
    sch.postprocess(sch.schedule()[0], [-1 + 1])
    assert not s.is_finished


def test_postprocess_length_mismatch() -> None:
    sch = make()
    with pytest.raises(ValueError, match="2 tokens for 1 sequences"):
        sch.postprocess([seq([1])], [1, 2])


def test_abort_releases_blocks() -> None:
    sch = make()
    a, b = seq([1, 2, 3]), seq([4])
    sch.add_sequence(a)
    sch.schedule()
    sch.add_sequence(b)
    sch.abort(a)
    sch.abort(b)
    assert sch.is_finished() and not used_block_ids(sch.block_manager)


def test_block_size_one_end_to_end() -> None:
    sch = make(num_blocks=6, block_size=1, max_model_length=64)
    a = seq([1, 2], block_size=1, max_tokens=4)
    b = seq([1, 2, 3], block_size=1, max_tokens=4)
    sch.add_sequence(a)
    sch.add_sequence(b)
    steps = 0
    while not sch.is_finished():
        batch, _ = sch.schedule()
        for s in batch:
            assert len(s.block_table) == len(s)
        sch.postprocess(batch, [50 + len(s) for s in batch])
        steps += 1
        assert steps < 100
    assert a.completion_token_ids == [52, 53, 54, 55]
    assert b.completion_token_ids == [53, 54, 55, 56]


def test_prompt_chunks_beside_decode_rows_are_capped() -> None:
    """Chunked prefill: while sequences decode, a newcomer's chunks get at most
    max_prefill_tokens_while_decoding tokens per step (the decode rows' wait stays short);
    once nobody decodes, a prompt takes the whole budget."""
    sch = make(num_blocks=64, enable_chunked_prefill=True, max_num_batched_tokens=40,
               max_prefill_tokens_while_decoding=8, max_model_length=128)
    alone = seq(list(range(1, 61)))
    sch.add_sequence(alone)
    batch, _ = sch.schedule()
    assert [s.num_new_tokens for s in batch] == [40]  # nobody decodes: the whole budget
    batch, _ = sch.schedule()
    assert [s.num_new_tokens for s in batch] == [20]  # its last chunk samples a token
    sch.postprocess(batch, [7])
    newcomer = seq(list(range(100, 130)))
    sch.add_sequence(newcomer)
    for chunk in (8, 8, 8, 6):
        batch, is_prefill = sch.schedule()
        assert is_prefill and [s.num_new_tokens for s in batch] == [1, chunk]
        done = newcomer.num_computed_tokens == 30  # its last chunk: it samples too
        sch.postprocess(batch if done else batch[:1], [7, 8] if done else [7])
    assert newcomer.num_completion_tokens == 1


def test_chunks_far_into_a_long_prompt_shrink_beside_decode_rows() -> None:
    """Beside decode rows, a chunk's attention grows with its position: past
    ATTENTION_BOUND_CONTEXT tokens the cap counts a token for more, so chunks shrink."""
    from myvllm.engine.capped_chunks import ATTENTION_BOUND_CONTEXT as long
    from myvllm.engine.scheduler import StepBudget

    def chunk(start: int, remaining: int, budget: int, prompt_budget: int,
              capped: bool) -> tuple[int, int]:
        """(tokens, cost) of the next chunk, as StepBudget.take_chunk takes it."""
        step = StepBudget(budget, prompt_budget, capped)
        n = step.take_chunk(start, remaining)
        return n, prompt_budget - step.prompt

    assert chunk(0, 10_000, 16384, 512, capped=True) == (512, 512)
    assert chunk(long - 512, 10_000, 16384, 512, capped=True) == (512, 512)
    # ~3x the context: 163 tokens fit the cap, cut to one whole tile of the prefill kernel
    # (a second tile of 35 rows would cost the attention of a full one)
    assert chunk(3 * long, 10_000, 16384, 512, capped=True) == (128, 388)
    assert chunk(long, 10_000, 16384, 512, capped=True) == (384, 420)  # 3 tiles, not 455
    assert chunk(long, 400, 16384, 512, capped=True) == (400, 440)  # the last chunk: all of it
    assert chunk(4 * long - 512, 10_000, 16384, 512, capped=True) == (128, 500)  # ~4x
    assert chunk(3 * long, 10_000, 16384, 512, capped=False) == (512, 512)
    assert chunk(3 * long, 100, 16384, 512, capped=True) == (100, 303)  # its last 100 tokens
    for start in range(0, 40_000, 997):  # never over the budget
        n, cost = chunk(start, 10_000, 16384, 300, capped=True)
        assert 1 <= n <= 300 and n <= cost <= 300


def test_a_capped_chunk_is_the_most_whole_tiles_that_fit() -> None:
    """capped_chunk_size's promises, over positions, prompt lengths, budgets and caps: a chunk
    holds at least one token (no capped step stalls a prompt), at most what the prompt has
    left and the step's budget; its cost is its true price, n * max(long, start + n) / long,
    which stays within the cap unless the chunk is one token; and a chunk that is not its
    prompt's last and holds more than a tile is the most whole tiles that fit both the
    budget and the cap."""
    from myvllm.engine.capped_chunks import ATTENTION_BOUND_CONTEXT as long
    from myvllm.engine.capped_chunks import CHUNK_TILE as tile
    from myvllm.engine.capped_chunks import capped_chunk_size

    def price(start: int, n: int) -> int:
        return -(-n * max(long, start + n) // long)

    for start in (0, 1, 127, long - 300, long - 1, long, long + 13, 3913, 6229, 3 * long,
                  5 * long + 7, 12 * long, 40_000):
        for remaining in (1, 2, tile - 1, tile, tile + 1, 2 * tile, 257, 1000, 5120, 30_000):
            for budget in (1, 64, tile, 2 * tile, 1000, 2048, 5120, 16384):
                for cap in {1, 8, 100, tile, 2 * tile, 768, 2048, 14_662, budget}:
                    if cap > budget:
                        continue
                    n, cost = capped_chunk_size(start, remaining, budget, cap)
                    where = (start, remaining, budget, cap, n, cost)
                    assert 1 <= n <= min(remaining, budget), where
                    assert cost == min(price(start, n), cap), where
                    assert n == 1 or price(start, n) <= cap, where
                    if tile < n < remaining:
                        more = n + tile
                        assert n % tile == 0, where
                        assert more > min(remaining, budget) or price(start, more) > cap, where


def test_decode_rows_that_nobody_streams_do_not_cap_prompt_chunks() -> None:
    """LLM.generate() hands its outputs back together at the end (Sequence.streamed False):
    beside its decoding sequences a prompt takes the whole budget; one streamed decode row
    is enough for the cap to hold again."""
    sch = make(num_blocks=64, enable_chunked_prefill=True, max_num_batched_tokens=40,
               max_prefill_tokens_while_decoding=8, max_model_length=128)
    batch_job = seq([1, 2, 3])
    batch_job.streamed = False
    sch.add_sequence(batch_job)
    batch, _ = sch.schedule()
    sch.postprocess(batch, [7])  # it decodes from now on
    newcomer = seq(list(range(100, 160)))
    newcomer.streamed = False
    sch.add_sequence(newcomer)
    batch, _ = sch.schedule()
    assert [s.num_new_tokens for s in batch] == [1, 39]  # no stream beside it: no cap
    sch.postprocess(batch[:1], [7])
    streamed = seq([4, 5, 6])
    sch.add_sequence(streamed)
    batch, _ = sch.schedule()
    assert [s.num_new_tokens for s in batch] == [1, 21, 3]  # nobody streams yet
    sch.postprocess(batch, [7, 8, 9])  # each sampled: all three decode now
    sch.add_sequence(seq(list(range(200, 240))))
    batch, _ = sch.schedule()
    assert [s.num_new_tokens for s in batch] == [1, 1, 1, 8]  # a stream decodes: capped


def test_only_a_streamed_decode_row_caps_prompt_chunks() -> None:
    """StepBudget.for_step caps the prompt chunks of a step while a streamed sequence decodes
    (one token to go, or none: its token is in flight), not while one is still part-way
    through its prompt, and only with chunked prefill and a cap."""
    from myvllm.engine.scheduler import StepBudget

    s = seq(list(range(1, 11)))
    for computed, capped in ((8, False), (9, True), (10, True)):
        s.num_computed_tokens = computed
        budget = StepBudget.for_step(64, 8, True, [s])
        assert (budget.tokens, budget.prompt, budget.capped) == (64, 8 if capped else 64, capped)
    assert not StepBudget.for_step(64, 8, False, [s]).capped
    assert not StepBudget.for_step(64, 0, True, [s]).capped
    s.streamed = False
    assert not StepBudget.for_step(64, 8, True, [s]).capped


def test_a_prompt_goes_in_chunks_of_the_budget_its_last_one_what_is_left() -> None:
    """Chunked prefill: a prompt longer than the step's budget takes the whole budget each
    step, then whatever is left (two tokens here) in one last chunk; only that one samples."""
    sch = make(enable_chunked_prefill=True, max_num_batched_tokens=8)
    s = seq(list(range(1, 19)))
    sch.add_sequence(s)
    for chunk in (8, 8, 2):
        batch, is_prefill = sch.schedule()
        assert is_prefill and batch == [s] and s.num_new_tokens == chunk
    assert s.num_computed_tokens == len(s) == 18
    sch.postprocess(batch, [7])
    assert s.completion_token_ids == [7]


def test_a_step_never_computes_more_than_its_token_budget() -> None:
    """A step computes at most max_num_batched_tokens tokens, decode rows included, also
    for a decode row behind a prompt in running: a short prompt admitted beside a capped
    chunk (cut to a whole tile, which leaves room) decodes before the long prompt ahead of
    it is in; once nothing streamed decodes, that prompt's chunk takes the whole budget and
    the decode row waits for a later step."""
    sch = make(num_blocks=128, block_size=16, enable_chunked_prefill=True,
               max_num_batched_tokens=256, max_prefill_tokens_while_decoding=256,
               max_model_length=1100)
    stream = seq([1, 2, 3], block_size=16, max_tokens=2)
    sch.add_sequence(stream)
    sch.postprocess(sch.schedule()[0], [7])  # it decodes: prompt chunks are capped
    long_prompt = seq(list(range(1, 1001)), block_size=16, max_tokens=2)
    short = seq([5] * 10, block_size=16, max_tokens=3)
    for s in (long_prompt, short):
        s.streamed = False
        sch.add_sequence(s)
    batch, _ = sch.schedule()
    assert [(s, s.num_new_tokens) for s in batch] == [(stream, 1), (long_prompt, 128),
                                                      (short, 10)]
    sch.postprocess([stream, short], [7, 7])  # stream finishes; short decodes now
    assert list(sch.running) == [long_prompt, short]
    while not sch.is_finished():
        batch, _ = sch.schedule()
        assert sum(s.num_new_tokens for s in batch) <= 256
        assert all(s.num_new_tokens >= 1 for s in batch)
        sampled = [s for s in batch if s.num_computed_tokens == len(s)]
        sch.postprocess(sampled, [7] * len(sampled))
    assert short.completion_token_ids == [7, 7, 7] and long_prompt.num_completion_tokens == 2


def test_a_sequence_whose_token_in_flight_is_its_last_holds_up_no_other() -> None:
    """Overlapped scheduling (async_scheduling): the next step is scheduled before the last
    one's tokens are read back. A sequence whose token in flight is its last (max_tokens)
    gets no row in it, and the sequences behind it in running still get theirs."""
    from myvllm.worker.pending_tokens import add_pending_token

    sch = make(enable_chunked_prefill=True)
    last, more = seq([1, 2, 3], max_tokens=1), seq([4, 5, 6], max_tokens=3)
    for s in (last, more):
        sch.add_sequence(s)
    in_flight, _ = sch.schedule()
    for s in in_flight:
        add_pending_token(s)  # as a step left in flight counts its tokens
    batch, _ = sch.schedule()
    assert batch == [more] and list(sch.running) == [last, more]
    sch.postprocess(in_flight, [7, 8])
    assert last.finish_reason == "length" and list(sch.running) == [more]


def test_aborting_the_first_completion_releases_the_others() -> None:
    """n > 1: the other completions wait for the first one's prompt to be scheduled, to share
    its blocks; aborted before that, the first completion hands them to waiting, and each
    is prefilled itself (none waits for a prefill that never comes)."""
    from myvllm.sample.forks import make_forks

    sch = make()
    first = seq([1, 2, 3, 4, 5], max_tokens=2, n=2)
    (other,) = make_forks(first)  # as EngineCore.add_sequence does
    sch.add_sequence(first)
    sch.abort(first)
    assert first.finish_reason == "abort" and list(sch.waiting) == [other]
    while not sch.is_finished():
        batch, _ = sch.schedule()
        sch.postprocess(batch, [9] * len(batch))
    assert other.completion_token_ids == [9, 9] and other.finish_reason == "length"


# ---------------------------------------------------------------- the features' doors
def test_a_plain_request_runs_no_feature_code(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forks, speculation, a request's own stop tokens: each behind its one check, which a
    plain request fails (eos and max_tokens are checked inline)."""
    from myvllm.engine import scheduler

    def feature(*args: object, **kwargs: object) -> object:
        raise AssertionError("a plain request ran feature code")

    for name in ("admit", "can_admit", "release_forks", "is_stop_token", "propose_for_row"):
        monkeypatch.setattr(scheduler, name, feature)
    sch = make(eos=7, enable_chunked_prefill=True)
    assert sch.speculator is None
    a, b = seq(PREFIX + [1], max_tokens=3), seq([1, 2, 3], max_tokens=5)
    for s in (a, b):
        assert s.extras is None
        sch.add_sequence(s)
    while not sch.is_finished():
        batch, _ = sch.schedule()
        sch.postprocess(batch, [7 if s is b else 5 for s in batch])
    assert (a.finish_reason, a.completion_token_ids) == ("length", [5, 5, 5])
    assert (b.finish_reason, b.completion_token_ids) == ("stop", [7])


def test_a_request_with_extras_stops_on_its_own_stop_tokens_after_min_tokens() -> None:
    sch = make(eos=7)
    s = seq([1, 2, 3], stop_token_ids=[9], min_tokens=2)
    sch.add_sequence(s)
    for token in (9, 9):  # a stop token before min_tokens does not stop it
        batch, _ = sch.schedule()
        sch.postprocess(batch, [token])
    assert (s.finish_reason, s.completion_token_ids) == ("stop", [9, 9])


def test_the_speculator_is_handed_in_or_made_from_the_config() -> None:
    from myvllm.spec_decode.scheduling import Speculator

    config = Config(num_kvcache_blocks=8, block_size=4, max_model_length=64,
                    speculative_method="ngram", num_speculative_tokens=2)
    speculator = Speculator(config)
    assert Scheduler(config, speculator).speculator is speculator
    assert isinstance(Scheduler(config).speculator, Speculator)
    assert make().speculator is None
    # A Speculator made from a Config without a method it has a proposer for is refused.
    with pytest.raises(ValueError, match="Config.speculative_method=None: allowed: 'ngram' or "
                                         "'draft'"):
        Speculator(Config(num_kvcache_blocks=8, block_size=4))
