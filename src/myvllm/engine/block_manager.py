"""BlockManager: the KV cache's bookkeeping (which block belongs to whom), not its contents.

The GPU holds one big K/V tensor cut into ``num_blocks`` blocks of ``block_size`` tokens.
This class decides which physical blocks a sequence uses (its ``block_table``) and how many
sequences share each block (``ref_count``). It never touches tensor memory: the ModelRunner
turns block tables into slot numbers and ``store_kvcache`` writes the values.

Prefix caching. A *full* block is identified by a hash chained over everything before it:

    tokens   [t0 t1 t2 t3][t4 t5 t6 t7][t8 t9]
    hash     h0 = H(-, b0)  h1 = H(h0, b1)   -1 (partial: no hash, never shared)

so equal hashes mean equal blocks *at the same position after the same prefix* (up to a
2^-64 collision in the chain; the block's own tokens are compared exactly). A new sequence
walks its blocks in order and reuses every block found in ``hash_to_block_id`` until the
first miss; it then only computes the rest.

Free blocks keep their hash and tokens. A sequence that finished leaves its full blocks
findable: the next request with the same prefix "revives" them, until the block is needed as
a fresh block for someone else. ``free_block_ids`` is ordered as an LRU list:

    free_block_ids:  [ partial/unhashed ... | hashed, least recently freed ... most recent ]
                       ^ handed out first from here                 deallocate appends here ^

Reviving takes a block out of the middle of that list, so it is a FreeBlockQueue (a deque
whose remove() is O(1): engine/free_block_queue.py).
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf

import numpy as np
import xxhash

from myvllm.engine.forks import num_shared_prompt_blocks
from myvllm.engine.free_block_queue import FreeBlockQueue
from myvllm.engine.sequence import Sequence


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
        # Handed out as a fresh block IS the first reference (its sequence deallocates it
        # once): from 0 that deallocate would leave it at -1, never free again.
        self.ref_count = 1
        self.hash = -1
        self.token_ids = []

    def __repr__(self) -> str:
        return f"Block(id={self.block_id}, ref_count={self.ref_count}, hash={self.hash})"


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int,
                 enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"BlockManager needs num_blocks >= 1 and block_size >= 1, "
                             f"got num_blocks={num_blocks}, block_size={block_size}")
        self.block_size: int = block_size
        self.enable_prefix_caching: bool = enable_prefix_caching
        self.blocks: list[Block] = [Block(i) for i in range(num_blocks)]
        # hash of a full block -> the block that holds it (free or in use)
        self.hash_to_block_id: dict[int, int] = {}
        self.free_block_ids: FreeBlockQueue = FreeBlockQueue(range(num_blocks))

    # ------------------------------------------------------------------ hashing
    @staticmethod
    def compute_hash(token_ids: SequenceOf[int], prefix: int = -1) -> int:
        """xxhash64 over the previous block's hash (if any) then the tokens as little-endian
        int64. Chaining makes a block's hash depend on the whole prefix, not just its own
        tokens: the same 16 tokens after different prompts have different K/V."""
        h = xxhash.xxh64()
        if prefix != -1:
            h.update(prefix.to_bytes(8, "little"))
        h.update(np.asarray(token_ids, dtype="<i8").tobytes())
        return h.intdigest()  # unsigned 64-bit: never -1

    def _match_prefix(self, seq: Sequence, hash_all: bool = True) -> tuple[list[int], list[int]]:
        """Hash the blocks of ``seq`` and find the leading run of cache hits.

        Returns (hashes, hits): hashes[i] is block i's chained hash (-1 when partial or prefix
        caching is off); hits are the block ids serving blocks 0..len(hits)-1. Without
        hash_all, hashing stops at the first miss (-1 after it): enough to find the hits,
        and a 16k-token prompt's thousand hashes are then computed chunk by chunk, as its
        chunks register their blocks, not all in the step that admits it.
        """
        hashes: list[int] = []
        hits: list[int] = []
        hit_set: set[int] = set()
        h = -1
        # A request that wants its prompt's logprobs needs the logits of every prompt token,
        # and a cached one has none: it reads no hit (vLLM's rule), though its blocks are
        # registered for later requests as any other's.
        missed = not self.enable_prefix_caching or seq.needs_prompt_logprobs
        for i in range(seq.num_blocks):
            if missed and not hash_all:  # nothing after the first miss is needed
                hashes += [-1] * (seq.num_blocks - i)
                break
            token_ids = seq.block(i)
            full = len(token_ids) == self.block_size
            if not (self.enable_prefix_caching and full):
                h = -1
            elif i < len(seq.block_hashes):  # hashed on an earlier look (can_allocate)
                h = seq.block_hashes[i]
            else:  # full blocks come first, so block i is the next one to memoise
                h = self.compute_hash(token_ids, h)
                seq.block_hashes.append(h)
            hashes.append(h)
            if missed:
                # The runner can skip only a leading run of cached tokens (the prefill
                # computes token_ids[num_cached_tokens:]), so after the first miss every
                # later block is computed, even if an equal block happens to be cached.
                continue
            block_id = self.hash_to_block_id.get(h, -1) if h != -1 else -1
            # A hit needs the hash AND the same tokens; a block already used by this sequence
            # can't serve a second position (only possible through a hash collision).
            if (block_id == -1 or self.blocks[block_id].token_ids != token_ids
                    or block_id in hit_set):
                missed = True
            else:
                hits.append(block_id)
                hit_set.add(block_id)
        if hits and len(hits) == seq.num_blocks:
            # Fully cached: the runner must still compute at least the last token (its logits
            # give the next token), so the last block is treated as a miss and recomputed in a
            # fresh block. Recomputing inside the cached block instead would write into a block
            # other sequences may be reading at that moment.
            hits.pop()
        return hashes, hits

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
        # Evict: remove the cache entry only if it still names this block (a later block with
        # the same hash may have taken the entry over).
        if block.hash != -1 and self.hash_to_block_id.get(block.hash) == block_id:
            del self.hash_to_block_id[block.hash]
        block.reset()
        return block_id

    def _reuse_block(self, block_id: int) -> None:
        """Take one more reference to a cached block; revive it if it was free."""
        block = self.blocks[block_id]
        if block.ref_count == 0:
            # Freed but still cached: take it out of the free list (O(1), see above).
            self.free_block_ids.remove(block_id)
        block.ref_count += 1

    def _release_block(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count <= 0:
            raise RuntimeError(f"block {block_id} released more often than referenced")
        block.ref_count -= 1
        if block.ref_count > 0:
            return  # another sequence still reads this block
        if block.hash != -1 and self.hash_to_block_id.get(block.hash) == block_id:
            # Findable cached block: keep its hash and tokens, append at the MRU end.
            self.free_block_ids.append(block_id)
        else:
            # Partial or no longer findable: no cache value, reuse it first.
            self.free_block_ids.appendleft(block_id)

    # ------------------------------------------------------------------ prefill
    def can_allocate(self, seq: Sequence) -> bool:
        """Enough free blocks for every block of seq that is not shared with a running seq?"""
        _, hits = self._match_prefix(seq, hash_all=False)
        shared = sum(1 for b in hits if self.blocks[b].ref_count > 0)
        # Hits on *free* cached blocks still come out of the free list (revived).
        return len(self.free_block_ids) >= seq.num_blocks - shared

    def allocate(self, seq: Sequence, num_computable: int | None = None) -> None:
        """Give seq a block table covering all its tokens, reusing cached prefix blocks.
        Hits come first and misses after, so reviving hit blocks (out of the middle of the
        free list) never races with popleft() handing the same block out as fresh.

        A fresh full block is registered (findable by later requests) when the step being
        scheduled writes it: every block, unless num_computable says that only the positions
        below it are (chunked prefill: register_full_blocks registers the rest later).
        """
        if seq.block_table:
            raise ValueError(f"sequence {seq.seq_id} already has blocks {seq.block_table}")
        # Registration needs every hash only when all blocks are registered now (num_computable
        # None); otherwise register_full_blocks hashes the rest as chunks write them.
        hashes, hits = self._match_prefix(seq, hash_all=num_computable is None)
        shared = sum(1 for b in hits if self.blocks[b].ref_count > 0)
        if len(self.free_block_ids) < seq.num_blocks - shared:
            raise RuntimeError(f"cannot allocate {seq.num_blocks - shared} blocks for sequence "
                               f"{seq.seq_id}: {len(self.free_block_ids)} free "
                               "(call can_allocate first)")
        for block_id in hits:
            self._reuse_block(block_id)
            seq.block_table.append(block_id)
        limit = seq.num_tokens if num_computable is None else num_computable
        for i in range(len(hits), seq.num_blocks):
            block_id = self._allocate_fresh_block()
            if hashes[i] != -1 and (i + 1) * self.block_size <= limit:
                # Register now: the K/V of this block is written in this very prefill step,
                # before any later step can read it through another block table. (Within the
                # step, store_kvcache writes all new K/V before attention reads any.)
                self.blocks[block_id].update(hashes[i], seq.block(i))
                self.hash_to_block_id[hashes[i]] = block_id
            seq.block_table.append(block_id)
        seq.num_cached_tokens = len(hits) * self.block_size
        # block_hashes lists the registered blocks only (register_full_blocks goes on from it).
        del seq.block_hashes[max(len(hits), limit // self.block_size):]

    # ------------------------------------------------------------------ forking (n > 1)
    # The completions of one prompt share its full prompt blocks (engine/forks.py): a block
    # is never written by two sequences, and no K/V is copied.
    def can_fork(self, seq: Sequence) -> bool:
        return len(self.free_block_ids) >= seq.num_blocks - num_shared_prompt_blocks(seq)

    def fork(self, source: Sequence, seq: Sequence) -> None:
        """Give seq, another completion of source's prompt, source's shared prompt blocks
        and fresh blocks for the rest. The caller makes sure source's K/V of those blocks is
        written by a step already scheduled (the first completion's last prompt chunk)."""
        if seq.block_table:
            raise ValueError(f"sequence {seq.seq_id} already has blocks {seq.block_table}")
        if seq.token_ids[:seq.num_prompt_tokens] != source.token_ids[:source.num_prompt_tokens]:
            raise ValueError(f"sequence {seq.seq_id} is no completion of sequence "
                             f"{source.seq_id}'s prompt")
        num_shared = num_shared_prompt_blocks(seq)
        if len(source.block_table) < num_shared:
            raise ValueError(f"sequence {source.seq_id} holds {len(source.block_table)} "
                             f"blocks, fewer than the {num_shared} to share")
        needed = seq.num_blocks - num_shared
        if len(self.free_block_ids) < needed:
            raise RuntimeError(f"cannot fork {needed} blocks for sequence {seq.seq_id}: "
                               f"{len(self.free_block_ids)} free (call can_fork first)")
        for block_id in source.block_table[:num_shared]:
            self._reuse_block(block_id)
            seq.block_table.append(block_id)
        for _ in range(num_shared, seq.num_blocks):
            seq.block_table.append(self._allocate_fresh_block())
        seq.num_cached_tokens = num_shared * self.block_size
        # The shared blocks are registered already (source's prompt chunks registered them);
        # register_full_blocks goes on after them for seq's own.
        seq.block_hashes = source.block_hashes[:num_shared]

    def deallocate(self, seq: Sequence) -> None:
        """Drop seq's references. Blocks reaching 0 go back to the free list, still cached.

        The walk is in reverse so that, among one sequence's blocks, the LAST block is freed
        first and thus evicted first: a prefix's first blocks are the ones most likely to be
        shared again (every longer prompt with that prefix needs them), so they live longest.
        """
        for block_id in reversed(seq.block_table):
            self._release_block(block_id)
        seq.block_table.clear()
        # seq.num_cached_tokens is left as it was: for a finished sequence it still says how
        # much of its (last) prefill came from the cache. Scheduler.preempt zeroes it, and
        # allocate() always sets it again.

    # ------------------------------------------------------------------ decode
    # Both are called AFTER the new token was counted in seq.num_tokens (appended, or
    # pending) but before its K/V is written. Its block is new exactly when the table is one
    # short, `len(seq.block_table) < seq.num_blocks`; the article's modulo test
    # `num_tokens % block_size == 1` says the same except at block_size 1, where every token
    # needs a new block and x % 1 is never 1 (the guide's "Growing by one token").
    # num_lookahead (speculative decoding): the step also writes the K/V of that many
    # proposed tokens after the last one, which may need blocks of their own; those are
    # released after the step (free_lookahead_blocks) and never registered.
    def _lookahead_blocks(self, seq: Sequence, num_lookahead: int) -> int:
        """Blocks past seq.num_blocks that num_lookahead more positions reach into."""
        return -(-(seq.num_tokens + num_lookahead) // self.block_size) - seq.num_blocks

    def can_append(self, seq: Sequence, num_lookahead: int = 0) -> bool:
        needed = seq.num_blocks - len(seq.block_table)  # 0 or 1 in decode
        needed += self._lookahead_blocks(seq, num_lookahead)
        return len(self.free_block_ids) >= needed

    def append(self, seq: Sequence, num_lookahead: int = 0) -> None:
        missing = seq.num_blocks - len(seq.block_table)
        if missing > 1:
            raise RuntimeError(f"sequence {seq.seq_id} is {missing} blocks short; append() "
                               "covers one new token per step")
        for _ in range(missing + self._lookahead_blocks(seq, num_lookahead)):
            seq.block_table.append(self._allocate_fresh_block())
        # This step writes the K/V of every position below num_tokens.
        self.register_full_blocks(seq, num_written=seq.num_tokens)

    def free_lookahead_blocks(self, seq: Sequence) -> None:
        """Release the blocks past the ones seq's tokens occupy: after a verification step,
        the blocks that held only rejected proposals (never registered: fresh blocks)."""
        while len(seq.block_table) > seq.num_blocks:
            self._release_block(seq.block_table.pop())

    def unregister_after(self, seq: Sequence, num_written: int) -> None:
        """Make seq's blocks past its first num_written tokens unfindable again: the step
        that was to write them was registered when it was scheduled, and then never ran."""
        keep = num_written // self.block_size
        for i in range(keep, len(seq.block_hashes)):
            block = self.blocks[seq.block_table[i]]
            if self.hash_to_block_id.get(block.hash) == block.block_id:
                del self.hash_to_block_id[block.hash]
            block.hash = -1
            block.token_ids = []
        del seq.block_hashes[keep:]

    def register_full_blocks(self, seq: Sequence, num_written: int) -> None:
        """Make seq's newly full blocks findable by later requests.

        A block may be registered once its tokens are all known (a pending token's value is
        not) and the K/V of all of them is written by a step queued before any later one
        (num_written: positions below it). append() calls this as it schedules the step that
        writes the block's last slot; with overlapped scheduling that slot's token is often
        still pending then, and Scheduler.postprocess calls this again once it is known.
        A running sequence's block_hashes are those of its full blocks registered so far
        (allocate() registered every full block of the prompt), in order.
        """
        if not self.enable_prefix_caching:
            return
        num_full = min(len(seq.token_ids), num_written) // self.block_size
        for i in range(len(seq.block_hashes), num_full):
            prefix = seq.block_hashes[i - 1] if i > 0 else -1
            token_ids = seq.block(i)
            h = self.compute_hash(token_ids, prefix)
            seq.block_hashes.append(h)
            block = self.blocks[seq.block_table[i]]
            block.update(h, token_ids)
            self.hash_to_block_id[h] = block.block_id
