"""What the tests ask of a BlockManager beyond its own interface."""

from __future__ import annotations

from myvllm.engine.block_manager import BlockManager


def used_block_ids(manager: BlockManager) -> set[int]:
    """The blocks some sequence holds (ref_count > 0)."""
    return {block.block_id for block in manager.blocks if block.ref_count > 0}
