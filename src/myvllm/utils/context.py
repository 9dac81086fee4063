"""The per-step batch description that layers and kernels read (get_context), set by the
ModelRunner around each forward pass (forward_context), so that no model's forward signature
carries it. The cost, implicit global state, is the guide's Step 4, "The per-step context".

Shapes (N = tokens in the step, B = sequences in the step):

    prefill   cu_seqlens_q   [B+1] int32  start of each sequence's *new* tokens in the flat batch
              cu_seqlens_k   [B+1] int32  start of each sequence's *whole* context (cached + new)
              max_seqlen_q / max_seqlen_k  Python ints, known on the host (no device sync)
              slot_mapping   [N]   int32  cache slot (block_id * block_size + offset) per new token
              block_tables   [B, max_blocks] int32, -1 padded; only set when a prefix is cached
                             (or the step is padded, below)
              q_tiles, decode_rows   GPU only, a padded chunked step's query tiles and
                             one-token rows (worker/padded_steps.py, kernels/tile_map.py)
    decode    slot_mapping   [B]   int32  slot of the one new token per sequence (-1 = padding)
              context_lens   [B]   int32  tokens of context including the new one
              block_tables   [B, max_blocks] int32, -1 padded
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from myvllm.kernels.tile_map import DecodeRows, TileMap


@dataclass
class Context:
    is_prefill: bool = False
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    slot_mapping: torch.Tensor | None = None
    context_lens: torch.Tensor | None = None
    block_tables: torch.Tensor | None = None
    q_tiles: TileMap | None = None
    decode_rows: DecodeRows | None = None


_EMPTY = Context()
_CONTEXT = _EMPTY


def get_context() -> Context:
    return _CONTEXT


@contextmanager
def forward_context(context: Context) -> Iterator[Context]:
    """Make ``context`` the one layers read inside the block, and always clear it after (a
    failed step cannot leak its batch into the next). Nesting is refused: an inner forward
    would replace the outer step's batch."""
    global _CONTEXT
    if _CONTEXT is not _EMPTY:
        raise RuntimeError("forward_context is already set: one forward pass at a time")
    _CONTEXT = context
    try:
        yield context
    finally:
        _CONTEXT = _EMPTY
