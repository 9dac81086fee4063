"""BlockManager: the KV cache's bookkeeping (which block belongs to whom), not its contents.

It decides which physical blocks a sequence uses (its ``block_table``) and how many sequences
share each (``ref_count``); the ModelRunner turns block tables into slots. Prefix caching: a
full block is found by a hash chained over every block before it (compute_hash: the same
tokens after two different pasts have different K/V, so a block's hash covers its prefix's
too). Freed blocks keep their hash and tokens until handed out again, least recently freed
first, from a FreeBlockQueue (the guide's Step 3 draws both).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator
from collections.abc import Sequence as SequenceOf

import numpy as np
import xxhash

from myvllm.engine.sequence import Sequence


def compute_hash(token_ids: SequenceOf[int], prefix: int = -1) -> int:
    """A full block's prefix-cache hash: xxhash64 over the previous block's hash (if any),
    then the tokens as int64."""
    h = xxhash.xxh64()
    if prefix != -1:
        h.update(prefix.to_bytes(8, "little"))
    h.update(np.asarray(token_ids, dtype="<i8").tobytes())
    return h.intdigest()  # unsigned 64-bit: never -1


class FreeBlockQueue:
    """The free list: free block ids in order, with the operations of a deque that the
    BlockManager uses, each O(1), remove() from the middle too.

    A prefix-cache hit on a freed block revives it, taking it out of the middle of the free
    list, once per block of every hit. A deque's remove() walks the list: 0.5-0.7 ms a block
    with the ~70,000 blocks of an H200's cache, more than computing the prompt. So the list is
    an OrderedDict used as an ordered set (vLLM keeps a doubly linked list of free blocks for
    the same reason)."""

    def __init__(self, block_ids: Iterable[int] = ()) -> None:
        self._ids: OrderedDict[int, None] = OrderedDict.fromkeys(block_ids)

    def popleft(self) -> int:
        return self._ids.popitem(last=False)[0]

    def append(self, block_id: int) -> None:
        self._ids[block_id] = None

    def appendleft(self, block_id: int) -> None:
        self._ids[block_id] = None
        self._ids.move_to_end(block_id, last=False)

    def remove(self, block_id: int) -> None:
        del self._ids[block_id]

    def clear(self) -> None:
        self._ids.clear()

    def __len__(self) -> int:
        return len(self._ids)

    def __iter__(self) -> Iterator[int]:
        return iter(self._ids)

    def __contains__(self, block_id: object) -> bool:
        return block_id in self._ids

    def __repr__(self) -> str:
        return f"FreeBlockQueue({list(self._ids)})"


class Block:
    def __init__(self, block_id: int) -> None:
        self.block_id: int = block_id
        self.ref_count: int = 0    # block tables that hold this block (0 = free)
        self.hash: int = -1        # chained hash of a full block; -1 = not full / not hashed
        self.token_ids: list[int] = []  # the tokens of a hashed block, to confirm a hash hit

    def update(self, hash: int, token_ids: list[int]) -> None:
        self.hash = hash
        self.token_ids = list(token_ids)

    def reset(self) -> None:
        # Being handed out IS the first reference (the guide's "Why ref_count starts at 1").
        self.ref_count = 1
        self.hash = -1
        self.token_ids = []

    def __repr__(self) -> str:
        return f"Block(id={self.block_id}, ref_count={self.ref_count}, hash={self.hash})"


class BlockManager:
    # The prefix cache's hash of a full block (a module function, so that it is also
    # reachable without a BlockManager).
    compute_hash = staticmethod(compute_hash)

    def __init__(self, num_blocks: int, block_size: int,
                 enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"BlockManager num_blocks={num_blocks}, block_size={block_size}: "
                             "allowed: an int >= 1 each")
        self.block_size: int = block_size
        self.enable_prefix_caching: bool = enable_prefix_caching
        self.blocks: list[Block] = [Block(i) for i in range(num_blocks)]
        # hash of a full block -> the block that holds it (free or in use)
        self.hash_to_block_id: dict[int, int] = {}
        self.free_block_ids: FreeBlockQueue = FreeBlockQueue(range(num_blocks))

    # ------------------------------------------------------------------ prefix matching
    def _match_prefix(self, seq: Sequence) -> list[int]:
        """The block ids serving seq's leading run of cached full blocks. Hashing stops at the
        first miss: a long prompt's later hashes are computed as its chunks register them."""
        hits: list[int] = []
        hit_set: set[int] = set()
        # A cached prompt token has no logits, so prompt logprobs read no hit (vLLM's rule).
        if not self.enable_prefix_caching or (seq.extras is not None
                                               and seq.extras.needs_prompt_logprobs):
            return hits
        h = -1
        for i in range(seq.num_blocks):
            token_ids = seq.block(i)
            if len(token_ids) < self.block_size:
                break  # a partial block is never cached
            if i < len(seq.block_hashes):  # hashed on an earlier look (can_allocate)
                h = seq.block_hashes[i]
            else:  # full blocks come first, so block i is the next one to memoise
                h = compute_hash(token_ids, h)
                seq.block_hashes.append(h)
            block_id = self.hash_to_block_id.get(h, -1)
            # A hit needs the hash AND the same tokens, and a block serves one position only.
            if (block_id == -1 or self.blocks[block_id].token_ids != token_ids
                    or block_id in hit_set):
                break
            hits.append(block_id)
            hit_set.add(block_id)
        if hits and len(hits) == seq.num_blocks:
            # Fully cached: the last token's logits are still needed, so the last block is
            # recomputed, in a fresh block (others may be reading the cached one).
            hits.pop()
        return hits

    # ------------------------------------------------------------------ block lifecycle
    def _allocate_fresh_block(self) -> int:
        """Hand out the least recently freed block, dropping whatever it cached."""
        if not self.free_block_ids:
            raise RuntimeError("no free KV-cache block: check can_allocate/can_append first")
        block_id = self.free_block_ids.popleft()
        block = self.blocks[block_id]
        if block.ref_count != 0:
            raise RuntimeError(f"free list holds block {block_id} with ref_count "
                               f"{block.ref_count}: the ref counts are corrupt")
        # Evict, unless a later block with the same hash took the entry over.
        if block.hash != -1 and self.hash_to_block_id.get(block.hash) == block_id:
            del self.hash_to_block_id[block.hash]
        block.reset()
        return block_id

    def _reuse_block(self, block_id: int) -> None:
        """Take one more reference to a cached block; revive it if it was free."""
        block = self.blocks[block_id]
        if block.ref_count == 0:
            self.free_block_ids.remove(block_id)  # freed but still cached: revived
        block.ref_count += 1

    def release_block(self, block_id: int) -> None:
        """Drop one reference; at 0 the block goes back to the free list."""
        block = self.blocks[block_id]
        if block.ref_count <= 0:
            raise RuntimeError(f"block {block_id} released more often than referenced")
        block.ref_count -= 1
        if block.ref_count > 0:
            return  # another sequence still reads this block
        if block.hash != -1 and self.hash_to_block_id.get(block.hash) == block_id:
            self.free_block_ids.append(block_id)  # still findable: evicted last
        else:
            self.free_block_ids.appendleft(block_id)  # caches nothing: handed out first

    # ------------------------------------------------------------------ prefill
    def can_allocate(self, seq: Sequence) -> bool:
        """Enough free blocks for every block of seq that is not shared with a running seq?"""
        hits = self._match_prefix(seq)
        shared = sum(1 for b in hits if self.blocks[b].ref_count > 0)
        # Hits on *free* cached blocks still come out of the free list (revived).
        return len(self.free_block_ids) >= seq.num_blocks - shared

    def allocate(self, seq: Sequence, num_computable: int | None = None) -> None:
        """Give seq a block table covering all its tokens, reusing cached prefix blocks. A
        fresh full block is registered (findable) if the step being scheduled writes it: all
        of them, or (chunked prefill) those below num_computable; register_full_blocks
        registers the rest later."""
        hits = self._match_prefix(seq)
        self.allocate_blocks(seq, hits)
        # block_hashes lists the registered blocks only (register_full_blocks goes on from it).
        del seq.block_hashes[len(hits):]
        # Registered before its K/V exists: this very step writes it, and within a step
        # store_kvcache writes all new K/V before attention reads any.
        self.register_full_blocks(seq, seq.num_tokens if num_computable is None else num_computable)

    def allocate_blocks(self, seq: Sequence, computed_blocks: list[int]) -> None:
        """seq's block table: computed_blocks (K/V already there: one more reference each),
        then fresh blocks for the rest. Shared blocks are taken first, so reviving one (out of
        the free list's middle) never races with popleft() handing it out as fresh."""
        if seq.block_table:
            raise ValueError(f"sequence {seq.seq_id} already has blocks {seq.block_table}")
        needed = seq.num_blocks - sum(1 for b in computed_blocks if self.blocks[b].ref_count > 0)
        if len(self.free_block_ids) < needed:
            raise RuntimeError(f"cannot allocate {needed} blocks for sequence {seq.seq_id}: "
                               f"{len(self.free_block_ids)} free (call can_allocate first)")
        for block_id in computed_blocks:
            self._reuse_block(block_id)
            seq.block_table.append(block_id)
        for _ in range(len(computed_blocks), seq.num_blocks):
            seq.block_table.append(self._allocate_fresh_block())
        seq.num_cached_tokens = len(computed_blocks) * self.block_size

    def deallocate(self, seq: Sequence) -> None:
        """Drop seq's references; blocks reaching 0 go back to the free list, still cached.
        In reverse, so a prefix's first blocks, the likeliest to be shared again, are freed
        last and thus evicted last. seq.num_cached_tokens stays (a finished sequence's)."""
        for block_id in reversed(seq.block_table):
            self.release_block(block_id)
        seq.block_table.clear()

    # ------------------------------------------------------------------ decode
    # Called after the new token is counted in seq.num_tokens, before its K/V is written: it
    # needs a block exactly when the table is one short (the guide's "Growing by one token").
    # num_lookahead (speculative decoding): blocks for that many proposed positions after
    # the tokens too; the scheduler keeps a row's proposals only if can_append(seq, k) holds.
    def num_blocks_to_allocate(self, seq: Sequence, num_lookahead: int = 0) -> int:
        """New blocks seq's table needs to hold its tokens and num_lookahead positions after
        them: the blocks they reach, ceil(positions / block_size), less those it holds."""
        return ((seq.num_tokens + num_lookahead + self.block_size - 1) // self.block_size
                - len(seq.block_table))

    def can_append(self, seq: Sequence, num_lookahead: int = 0) -> bool:
        return len(self.free_block_ids) >= self.num_blocks_to_allocate(seq, num_lookahead)

    def append(self, seq: Sequence, num_lookahead: int = 0) -> None:
        missing = self.num_blocks_to_allocate(seq, num_lookahead)
        # 0 or 1 for a plain decode row; more only with a lookahead, so only then is the
        # one-token rule counted on its own (and a plain row counts its blocks once).
        if missing > 1 and (short := self.num_blocks_to_allocate(seq)) > 1:
            raise RuntimeError(f"sequence {seq.seq_id} is {short} blocks short; append() "
                               "covers one new token per step")
        for _ in range(missing):
            seq.block_table.append(self._allocate_fresh_block())
        # This step writes the K/V of every position below num_tokens.
        self.register_full_blocks(seq, num_written=seq.num_tokens)

    def register_full_blocks(self, seq: Sequence, num_written: int) -> None:
        """Make seq's newly full blocks findable: once all their tokens are known (a pending
        token's value is not) and a step queued before any later one writes their K/V (the
        positions below num_written). seq.block_hashes: its registered blocks, in order."""
        if not self.enable_prefix_caching:
            return
        num_full = min(len(seq.token_ids), num_written) // self.block_size
        for i in range(len(seq.block_hashes), num_full):
            prefix = seq.block_hashes[i - 1] if i > 0 else -1
            token_ids = seq.block(i)
            h = compute_hash(token_ids, prefix)
            seq.block_hashes.append(h)
            block = self.blocks[seq.block_table[i]]
            block.update(h, token_ids)
            self.hash_to_block_id[h] = block.block_id
