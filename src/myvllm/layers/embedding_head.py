"""Vocabulary-parallel token embedding and LM head: rank r holds rows [r V/tp, (r+1) V/tp) of
the [vocab, hidden] table (ceil(V/tp) rows each, zero padding past V). With one rank they are
a lookup and a matmul of the whole table; with tp > 1 the embedding sums the ranks' rows and
the LM head gathers the logits on rank 0, the only rank that samples (the others return None):
layers/vocab_parallel.py. Each weight's loader is load_vocab_parallel (layers/weight_loaders.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from myvllm.kernels import linear
from myvllm.kernels.linear_kernels import pad_rows_to_power_of_two
from myvllm.layers.vocab_parallel import embed_own_rows, gather_logits, vocab_shard
from myvllm.layers.weight_loaders import load_vocab_parallel, set_weight_attrs
from myvllm.utils.context import get_context
from myvllm.utils.distributed import get_tp_rank, get_tp_size


class VocabParallelEmbedding(nn.Module):
    weight_loader = load_vocab_parallel

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.tp_rank = get_tp_rank()
        self.tp_size = get_tp_size()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        # This rank's rows of the table (all of them with one rank): layers/vocab_parallel.py.
        (self.num_embeddings_per_partition, self.vocab_start_idx,
         self.vocab_end_idx) = vocab_shard(num_embeddings, self.tp_rank, self.tp_size)
        self.weight = nn.Parameter(torch.empty(self.num_embeddings_per_partition, embedding_dim))
        set_weight_attrs(self.weight, {"weight_loader": self.weight_loader})

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        return embed_own_rows(self.weight, input_ids, self.vocab_start_idx, self.vocab_end_idx)


class ParallelLMHead(VocabParallelEmbedding):
    """hidden [N, H] -> logits [B, V] on rank 0, None elsewhere; a prefill keeps each
    sequence's last token only (the guide's Step 1 draws which rows)."""

    # The override returns None where the embedding returns a tensor: only rank 0 gets the
    # logits (the sampler runs there), so the narrower return type cannot hold.
    def forward(self, x: torch.Tensor) -> torch.Tensor | None:  # type: ignore[override]
        context = get_context()
        num_rows = x.size(0)
        if context.is_prefill and context.cu_seqlens_q is not None:
            rows = context.cu_seqlens_q[1:] - 1  # each sequence's last new token
            num_rows = rows.numel()
            if x.is_cuda:  # a row count whose cuBLAS kernel is loaded already
                rows = pad_rows_to_power_of_two(rows)
            x = x[rows].contiguous()
        logits = linear(x, self.weight)
        if self.tp_size > 1:  # the ranks' slices of the vocabulary, side by side on rank 0
            return gather_logits(logits, self.tp_rank, self.tp_size, num_rows,
                                 self.num_embeddings)
        return logits[:num_rows, : self.num_embeddings]

