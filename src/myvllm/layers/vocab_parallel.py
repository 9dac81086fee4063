"""Tensor parallelism's side of the vocabulary layers (layers/embedding_head.py): with tp > 1
rank r holds rows [r V/tp, (r+1) V/tp) of the [vocab, hidden] table, so

    embedding  each rank looks up the ids it owns, zeros for the others; all_reduce sums them
    LM head    each rank's logits are its slice of the vocabulary; rank 0 gathers the slices
               side by side (it alone samples), the others get None

With one rank neither runs: the layers look up and multiply the whole table themselves
(vocab_shard, which splits the rows, runs when a layer is built).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from myvllm.utils.distributed import all_reduce, gather_on_rank0


def vocab_shard(num_embeddings: int, tp_rank: int, tp_size: int) -> tuple[int, int, int]:
    """Rank tp_rank's share of a table of num_embeddings rows: (rows each rank holds,
    ceil(V/tp); its first row; one past its last). The last rank's rows past V are padding."""
    per_partition = -(-num_embeddings // tp_size)  # ceil
    start = min(tp_rank * per_partition, num_embeddings)
    return per_partition, start, min(start + per_partition, num_embeddings)


def embed_own_rows(weight: torch.Tensor, input_ids: torch.Tensor, vocab_start_idx: int,
                   vocab_end_idx: int) -> torch.Tensor:
    """The embedding of input_ids summed over the ranks, each adding the rows it owns."""
    mask = (input_ids >= vocab_start_idx) & (input_ids < vocab_end_idx)
    # Ids owned by another rank look up row 0 here; the mask then zeroes that row.
    # Both steps are needed: without the second, every rank would add its row 0.
    local_ids = torch.where(mask, input_ids - vocab_start_idx, 0)
    y = F.embedding(local_ids, weight) * mask.unsqueeze(-1).to(weight.dtype)
    return all_reduce(y)


def gather_logits(logits: torch.Tensor, tp_rank: int, tp_size: int, num_rows: int,
                  vocab_size: int) -> torch.Tensor | None:
    """Rank 0: the ranks' slices of the vocabulary side by side, [num_rows, vocab_size] (the
    last rank's padding rows cut); None on the other ranks."""
    gathered = gather_on_rank0(logits, tp_rank, tp_size)
    return None if gathered is None else gathered[:num_rows, :vocab_size]
