"""What the BlockManager takes back after a step: the blocks of rejected proposals, and the
prefix-cache entries of a step that never ran.

BlockManager derives from BlockRollback, so callers still call these on the block manager.

Speculative decoding: a decode row with k proposals gets blocks for k more positions
(``_lookahead_blocks``, through ``BlockManager.append(seq, num_lookahead=k)``). They are never
registered (registration reads token_ids, where proposals never are), and after the
verification step the ones past the accepted tokens go back (``free_lookahead_blocks``;
spec_decode/scheduling.py draws the rollback).

A failed step (undo_step, engine/queued_steps.py): its blocks were registered when it was
scheduled, as if written; since it never ran, ``unregister_after`` makes them unfindable again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from myvllm.engine.block_manager import Block
    from myvllm.engine.sequence import Sequence


class BlockRollback:
    # BlockManager's
    block_size: int
    blocks: list[Block]
    hash_to_block_id: dict[int, int]

    if TYPE_CHECKING:
        def _release_block(self, block_id: int) -> None: ...

    def _lookahead_blocks(self, seq: Sequence, num_lookahead: int) -> int:
        """Blocks past seq.num_blocks that num_lookahead more positions reach into."""
        return -(-(seq.num_tokens + num_lookahead) // self.block_size) - seq.num_blocks

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
