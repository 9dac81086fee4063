"""BlockManager: ref counts, the can_append off-by-one, and prefix caching across requests."""

from collections import deque

import pytest
from hypothesis import given
from hypothesis import strategies as st

from myvllm.engine import block_manager
from myvllm.engine.block_manager import Block, BlockManager, FreeBlockQueue, compute_hash
from myvllm.engine.sequence import Sequence
from helpers_blocks import used_block_ids

PREFIX = [10, 20, 30, 40, 50, 60, 70, 80]  # two full blocks of 4


def check_consistent(bm: BlockManager, *seqs: Sequence) -> None:
    free = list(bm.free_block_ids)
    assert len(free) == len(set(free)) and not set(free) & used_block_ids(bm)
    assert set(free) | used_block_ids(bm) == set(range(len(bm.blocks)))
    for block in bm.blocks:
        holders = sum(s.block_table.count(block.block_id) for s in seqs)
        assert block.ref_count == holders, block
    for h, block_id in bm.hash_to_block_id.items():
        assert bm.blocks[block_id].hash == h


def test_block_reset_is_the_first_reference() -> None:
    b = Block(3)
    b.update(123, [1, 2])
    b.reset()
    assert (b.ref_count, b.hash, b.token_ids) == (1, -1, [])


def test_compute_hash_is_chained_and_exact() -> None:
    h = compute_hash
    assert h([1, 2, 3]) == h([1, 2, 3])
    assert h([1, 2, 3]) != h([3, 2, 1])
    assert h([1, 2, 3], prefix=h([9])) != h([1, 2, 3])
    assert h([1, 2, 3], prefix=h([9])) != h([1, 2, 3], prefix=h([8]))
    assert h([2**40]) != h([0])  # ids are hashed as 64-bit, not truncated
    assert h([5]) != -1


def test_allocate_and_deallocate_ref_counts() -> None:
    bm = BlockManager(8, 4)
    s = Sequence(list(range(10)), 4)
    assert bm.can_allocate(s)
    bm.allocate(s)
    assert s.block_table == [0, 1, 2] and s.num_cached_tokens == 0
    assert [bm.blocks[i].ref_count for i in range(3)] == [1, 1, 1]
    # full blocks are hashed (chained), the partial last block is not
    h0 = compute_hash(list(range(4)))
    assert bm.blocks[0].hash == h0
    assert bm.blocks[1].hash == compute_hash([4, 5, 6, 7], h0)
    assert bm.blocks[2].hash == -1
    check_consistent(bm, s)
    bm.deallocate(s)
    assert s.block_table == [] and used_block_ids(bm) == set()
    check_consistent(bm)


def test_can_allocate_counts_blocks() -> None:
    bm = BlockManager(2, 4)
    assert bm.can_allocate(Sequence(list(range(8)), 4))
    assert not bm.can_allocate(Sequence(list(range(9)), 4))


# ---------------------------------------------------------------- the can_append probe
def test_can_append_probe_block_size_4() -> None:
    """can_append is called after the token is counted: at % 4 == 0 the token fills the
    last slot of the block it already has, so it needs no new block."""
    bm = BlockManager(4, 4)
    s = Sequence([1, 2, 3], 4)
    bm.allocate(s)
    bm.free_block_ids.clear()  # empty free list, by hand
    s.append_token(4)  # num_tokens = 4: fills the block it already holds
    assert s.num_tokens % 4 == 0 and bm.can_append(s) is True
    bm.append(s)
    assert s.block_table == [0]
    assert bm.blocks[0].hash == compute_hash([1, 2, 3, 4])  # full now: hashed
    assert bm.hash_to_block_id[bm.blocks[0].hash] == 0
    s.append_token(5)  # num_tokens = 5: first token of a new block
    assert s.num_tokens % 4 == 1 and bm.can_append(s) is False


def test_can_append_block_size_8_at_24_tokens() -> None:
    bm = BlockManager(3, 8)
    s = Sequence(list(range(23)), 8)
    bm.allocate(s)
    assert not bm.free_block_ids
    s.append_token(99)
    assert s.num_tokens == 24 and bm.can_append(s)
    bm.append(s)
    assert len(s.block_table) == 3


def test_append_allocates_new_block_when_available() -> None:
    bm = BlockManager(4, 4)
    s = Sequence([1, 2, 3, 4], 4)
    bm.allocate(s)
    s.append_token(5)
    assert bm.can_append(s)
    bm.append(s)
    assert s.block_table == [0, 1] and bm.blocks[1].hash == -1


def test_block_size_1() -> None:
    """Every token needs a new block; `num_tokens % 1 == 1` would never say so."""
    bm = BlockManager(4, 1)
    s = Sequence([7, 8], 1)
    bm.allocate(s)
    assert s.block_table == [0, 1]
    s.append_token(9)
    assert bm.can_append(s)
    bm.append(s)
    assert s.block_table == [0, 1, 2]
    h0 = compute_hash([7])
    h1 = compute_hash([8], h0)
    assert bm.blocks[2].hash == compute_hash([9], h1)
    s.append_token(10)
    bm.append(s)
    s.append_token(11)
    assert not bm.can_append(s)
    # a second sequence with the same first tokens reuses them
    t = Sequence([7, 8, 9, 5], 1)
    bm.deallocate(s)
    bm.allocate(t)
    assert t.num_cached_tokens == 3 and t.block_table[:3] == [0, 1, 2]
    check_consistent(bm, t)


# ---------------------------------------------------------------- prefix caching
def test_shared_prefix_between_live_sequences() -> None:
    bm = BlockManager(8, 4)
    a, b = Sequence(PREFIX + [1], 4), Sequence(PREFIX + [2], 4)
    bm.allocate(a)
    bm.allocate(b)
    assert a.block_table == [0, 1, 2] and b.block_table == [0, 1, 3]
    assert (a.num_cached_tokens, b.num_cached_tokens) == (0, 8)
    check_consistent(bm, a, b)
    bm.deallocate(a)  # b keeps reading blocks 0 and 1: nothing copied, only counts drop
    assert bm.blocks[0].ref_count == 1 and 0 in used_block_ids(bm)
    check_consistent(bm, b)


def test_prefix_cache_survives_the_sequence_that_filled_it() -> None:
    bm = BlockManager(8, 4)
    a = Sequence(PREFIX + [1], 4)
    bm.allocate(a)
    bm.deallocate(a)
    assert not used_block_ids(bm) and len(bm.hash_to_block_id) == 2
    b = Sequence(PREFIX + [2, 3], 4)
    assert bm.can_allocate(b)
    bm.allocate(b)
    assert b.block_table[:2] == [0, 1] and b.num_cached_tokens == 8
    assert 0 not in bm.free_block_ids and 1 not in bm.free_block_ids  # revived
    check_consistent(bm, b)


def test_can_allocate_counts_revived_blocks_against_free_list() -> None:
    bm = BlockManager(3, 4)
    a = Sequence(PREFIX, 4)
    bm.allocate(a)
    # a holds 2 blocks, 1 free. A sequence sharing both full blocks needs 1 fresh block
    # (its last block is recomputed); a different one needs 3.
    assert bm.can_allocate(Sequence(PREFIX + [1], 4))
    assert not bm.can_allocate(Sequence([1] * 9, 4))
    bm.deallocate(a)
    # free and cached now: reviving still takes blocks out of the free list (3 needed, 3 free)
    assert bm.can_allocate(Sequence(PREFIX + [1], 4))


def test_deallocate_order_and_lru_eviction() -> None:
    bm = BlockManager(6, 2)
    p = Sequence([1, 2, 3, 4, 5], 2)  # blocks 0,1 full, 2 partial
    bm.allocate(p)
    q = Sequence([7, 7, 8, 8], 2)  # blocks 3,4
    bm.allocate(q)
    bm.deallocate(p)  # freed first
    bm.deallocate(q)  # freed later
    # partial block 2 goes first (left); hashed blocks in order freed, last block first
    assert list(bm.free_block_ids) == [2, 5, 1, 0, 4, 3]
    # a 4-block request with no hits takes 2, 5, then evicts p's last block, then p's first
    r = Sequence([9] * 8, 2)
    bm.allocate(r)
    assert r.block_table == [2, 5, 1, 0] and r.num_cached_tokens == 0
    # q (freed later) is still cached; p is gone
    q2 = Sequence([7, 7, 8, 8, 9], 2)
    p2 = Sequence([1, 2, 3, 4, 5], 2)
    bm.deallocate(r)
    assert bm.can_allocate(q2)
    bm.allocate(q2)
    assert q2.num_cached_tokens == 4 and q2.block_table[:2] == [3, 4]
    bm.allocate(p2)
    assert p2.num_cached_tokens == 0
    check_consistent(bm, q2, p2)


def test_evicting_a_superseded_block_keeps_the_newer_entry() -> None:
    bm = BlockManager(4, 2)
    a = Sequence([1, 2], 2)
    bm.allocate(a)  # block 0, registered under h
    b = Sequence([1, 2], 2)
    bm.allocate(b)  # fully cached: recomputed in fresh block 1, which takes the entry over
    h = bm.blocks[0].hash
    assert b.block_table == [1] and bm.hash_to_block_id[h] == 1 and bm.blocks[1].hash == h
    bm.deallocate(a)  # block 0 is no longer findable: plain free space, reused first
    assert next(iter(bm.free_block_ids)) == 0
    c = Sequence([9], 2)
    bm.allocate(c)  # evicts block 0: must not delete the entry that names block 1
    assert c.block_table == [0] and bm.hash_to_block_id[h] == 1
    d = Sequence([1, 2, 5], 2)
    bm.allocate(d)
    assert d.block_table[0] == 1 and d.num_cached_tokens == 2
    check_consistent(bm, b, c, d)


def test_fully_cached_prompt_recomputes_its_last_block() -> None:
    bm = BlockManager(8, 4)
    a = Sequence(PREFIX, 4)
    bm.allocate(a)
    b = Sequence(PREFIX, 4)
    bm.allocate(b)
    # both blocks match, but the last one is recomputed in a fresh block so that at least
    # one token runs through the model, without writing into a's block 1
    assert b.block_table == [0, 2] and b.num_cached_tokens == 4
    assert bm.blocks[1].ref_count == 1 and bm.blocks[0].ref_count == 2
    check_consistent(bm, a, b)
    # same when the cached blocks are free
    bm.deallocate(a)
    bm.deallocate(b)
    c = Sequence(PREFIX, 4)
    bm.allocate(c)
    assert c.num_cached_tokens == 4 and len(c.block_table) == 2
    check_consistent(bm, c)


def test_single_full_block_prompt_fully_cached() -> None:
    bm = BlockManager(4, 4)
    a = Sequence([1, 2, 3, 4], 4)
    bm.allocate(a)
    b = Sequence([1, 2, 3, 4], 4)
    bm.allocate(b)
    assert b.num_cached_tokens == 0 and b.block_table == [1]


def test_after_first_miss_every_block_misses() -> None:
    bm = BlockManager(8, 4)
    a = Sequence(PREFIX + [1], 4)
    bm.allocate(a)
    # block 0 differs; block 1 has the same tokens but a different prefix -> different hash
    b = Sequence([11, 20, 30, 40, 50, 60, 70, 80, 1], 4)
    bm.allocate(b)
    assert b.num_cached_tokens == 0 and set(b.block_table).isdisjoint(a.block_table)


def test_hash_collision_is_not_a_hit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(block_manager, "compute_hash", lambda token_ids, prefix=-1: 12345)
    bm = BlockManager(8, 4)
    a = Sequence(PREFIX + [1], 4)
    bm.allocate(a)
    b = Sequence([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)  # same (constant) hashes, other tokens
    assert bm.can_allocate(b)
    bm.allocate(b)
    assert b.num_cached_tokens == 0 and set(b.block_table).isdisjoint(a.block_table)
    check_consistent(bm, a, b)


def test_prefix_caching_disabled() -> None:
    bm = BlockManager(8, 4, enable_prefix_caching=False)
    a = Sequence(PREFIX + [1], 4)
    bm.allocate(a)
    b = Sequence(PREFIX + [2], 4)
    bm.allocate(b)
    assert b.num_cached_tokens == 0 and b.block_table == [3, 4, 5]
    assert bm.hash_to_block_id == {} and all(blk.hash == -1 for blk in bm.blocks)
    b.append_token(3)
    b.append_token(4)
    b.append_token(5)
    bm.append(b)  # block filled in decode: still not hashed
    assert bm.hash_to_block_id == {}
    check_consistent(bm, a, b)


def test_decode_filled_block_is_shared_later() -> None:
    bm = BlockManager(8, 4)
    a = Sequence([1, 2, 3], 4)
    bm.allocate(a)
    a.append_token(4)
    bm.append(a)  # registers [1,2,3,4]
    b = Sequence([1, 2, 3, 4, 5], 4)
    bm.allocate(b)
    assert b.num_cached_tokens == 4 and b.block_table[0] == a.block_table[0]


def test_misuse_raises() -> None:
    bm = BlockManager(1, 4)
    a = Sequence([1, 2, 3, 4, 5], 4)
    with pytest.raises(RuntimeError, match="can_allocate"):
        bm.allocate(a)
    b = Sequence([1], 4)
    bm.allocate(b)
    with pytest.raises(ValueError, match="already has blocks"):
        bm.allocate(b)
    with pytest.raises(ValueError, match="num_blocks=0, block_size=4: allowed: an int >= 1 each"):
        BlockManager(0, 4)


def test_a_prompt_is_hashed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """can_allocate and allocate (and a re-allocation after preemption) share the hashes."""
    calls = []
    monkeypatch.setattr(block_manager, "compute_hash", lambda token_ids, prefix=-1: (
        calls.append(1) or compute_hash(token_ids, prefix)))
    bm = BlockManager(8, 4)
    seq = Sequence(PREFIX + [90, 91, 92, 93, 94], 4)  # three full blocks, one partial
    assert bm.can_allocate(seq)
    bm.allocate(seq)
    # Block 0 twice: can_allocate's look stops at its miss, and allocate registers it.
    assert len(calls) == 4 and seq.block_hashes == [bm.blocks[b].hash for b in seq.block_table[:3]]
    bm.deallocate(seq)  # preempted: the same blocks are found again, nothing is re-hashed
    assert bm.can_allocate(seq)
    bm.allocate(seq)
    assert len(calls) == 4 and seq.num_cached_tokens == 12
    check_consistent(bm, seq)


# ---------------------------------------------------------------- the free list
@given(st.lists(st.tuples(st.sampled_from(["popleft", "append", "appendleft", "remove"]),
                          st.integers(0, 7)), max_size=60))
def test_free_block_queue_behaves_as_a_deque(ops: list[tuple[str, int]]) -> None:
    """The free list has a deque's operations and order, remove() in O(1): each run of random
    operations leaves it equal to a deque given the same (ids kept unique, as block ids are)."""
    queue, reference = FreeBlockQueue(range(4)), deque(range(4))
    for op, block_id in ops:
        if op == "popleft":
            if reference:
                assert queue.popleft() == reference.popleft()
        elif op == "remove":
            if block_id in reference:
                queue.remove(block_id)
                reference.remove(block_id)
        elif block_id not in reference:  # append / appendleft of an id not in the list
            getattr(queue, op)(block_id)
            getattr(reference, op)(block_id)
        assert list(queue) == list(reference) and len(queue) == len(reference)
        assert bool(queue) == bool(reference)
        if reference:
            assert all(b in queue for b in reference) and 99 not in queue


def test_compute_hash_is_the_block_managers() -> None:
    bm = BlockManager(4, 4)
    assert BlockManager.compute_hash([1, 2, 3, 4]) == bm.compute_hash([1, 2, 3, 4]) == (
        compute_hash([1, 2, 3, 4]))


def test_lookahead_blocks_are_taken_and_given_back() -> None:
    from myvllm.spec_decode.scheduling import free_lookahead_blocks

    bm = BlockManager(8, 4)
    s = Sequence([1, 2, 3, 4, 5], 4)  # 2 blocks; 3 proposals reach into none more
    bm.allocate(s)
    assert bm.can_append(s, num_lookahead=3) and not bm.can_append(s, num_lookahead=100)
    bm.append(s, num_lookahead=4)  # 9 positions: a third block
    assert len(s.block_table) == 3 and len(bm.free_block_ids) == 5
    free_lookahead_blocks(bm, s)  # none accepted: back to the blocks its tokens occupy
    assert len(s.block_table) == 2 and len(bm.free_block_ids) == 6
    check_consistent(bm, s)


# ---------------------------------------------------------------- misuse leaves no trace
def test_a_failed_allocate_changes_nothing() -> None:
    """allocate without room raises before it takes any block: the ref counts, the free list
    and the cache stay as they were, with the prefix hits on live blocks (shared) and on
    freed ones (to be revived) both counted right."""
    bm = BlockManager(3, 4)
    a = Sequence(PREFIX, 4)
    bm.allocate(a)  # blocks 0 and 1, cached; one block free
    for live in (True, False):
        if not live:
            bm.deallocate(a)  # 0 and 1 free but still cached: three free in all
        b = Sequence(PREFIX + [1, 2, 3, 4, 5], 4)  # two hits, two blocks more: one too many
        before = ([blk.ref_count for blk in bm.blocks], list(bm.free_block_ids),
                  dict(bm.hash_to_block_id))
        assert not bm.can_allocate(b)
        with pytest.raises(RuntimeError, match="can_allocate"):
            bm.allocate(b)
        assert b.block_table == [] and before == (
            [blk.ref_count for blk in bm.blocks], list(bm.free_block_ids),
            dict(bm.hash_to_block_id))
        check_consistent(bm, *([a] if live else []))


def test_a_block_released_once_too_often_raises() -> None:
    """A free block (ref_count 0) cannot be released again: that would put it twice in the
    free list, and two sequences would get it."""
    bm = BlockManager(2, 4)
    a = Sequence([1, 2, 3], 4)
    bm.allocate(a)
    block_id = a.block_table[0]
    bm.deallocate(a)
    with pytest.raises(RuntimeError):
        bm.release_block(block_id)
    assert list(bm.free_block_ids).count(block_id) == 1 and bm.blocks[block_id].ref_count == 0


def test_append_refuses_a_sequence_more_than_one_block_short() -> None:
    """append covers the one token a decode step adds; a sequence two blocks short (tokens
    added without a step) is an error, not a silent table that is still short."""
    bm = BlockManager(8, 4)
    s = Sequence([1, 2, 3, 4], 4)
    bm.allocate(s)
    for t in range(5, 10):  # 9 tokens: 3 blocks needed, 1 held
        s.append_token(t)
    with pytest.raises(RuntimeError):
        bm.append(s)
    assert s.block_table == [0] and len(bm.free_block_ids) == 7


def test_one_cached_block_serves_one_position_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two blocks of a prompt with the same tokens and (colliding) hash are two positions:
    the cached block serves the first only, the second is computed in its own block."""
    monkeypatch.setattr(block_manager, "compute_hash", lambda token_ids, prefix=-1: 12345)
    bm = BlockManager(8, 4)
    a = Sequence([1, 2, 3, 4, 9], 4)
    bm.allocate(a)  # block 0 holds [1, 2, 3, 4] under the hash 12345
    b = Sequence([1, 2, 3, 4, 1, 2, 3, 4, 9], 4)
    bm.allocate(b)
    assert b.block_table[0] == a.block_table[0] and b.num_cached_tokens == 4
    assert len(set(b.block_table)) == len(b.block_table)
    check_consistent(bm, a, b)
