"""How each parameter cuts its rank's piece out of a checkpoint's full tensor.

Checkpoints always hold the FULL tensors. Every parameter of a tensor-parallel layer carries
a ``weight_loader(param, loaded_weight, shard_id=None)`` (set_weight_attrs) that checks the
full tensor's shape, cuts this rank's slice out of it and copies it in, at the right offset
for packed layers (q/k/v, gate/up). The loader (utils/loader.py) never copies a tensor itself:
that is the whole contract, and the reason a world size of 2 loads the same model as a world
size of 1.

Each layer of layers/linear.py and layers/embedding_head.py names its loader, one of the
functions below (a function in its class body becomes its method, taking the layer first):

    ReplicatedLinear             load_replicated        the whole tensor
    ColumnParallelLinear         load_column_parallel   rank r's rows (output features)
    MergedColumnParallelLinear   load_merged_columns    gate's or up's rows, side by side
    QKVParallelLinear            load_qkv               q's, k's or v's whole heads
    RowParallelLinear            load_row_parallel      rank r's columns (input features)
    VocabParallelEmbedding       load_vocab_parallel    rank r's rows of the vocabulary

They run when the model is loaded, never in a step. layers/fused_moe.py's experts use the
helpers at the end of the file.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn


class ShardedLayer(Protocol):
    """What a loader reads of its layer: this rank's place among the tensor-parallel ranks."""

    tp_rank: int
    tp_size: int


class PackedColumns(ShardedLayer, Protocol):
    """MergedColumnParallelLinear: the full output size of each packed matmul."""

    output_sizes: list[int]


class PackedHeads(ShardedLayer, Protocol):
    """QKVParallelLinear: the heads this rank holds, and their size."""

    num_heads: int
    num_kv_heads: int
    head_size: int


class VocabRows(Protocol):
    """VocabParallelEmbedding (and the LM head): the vocabulary rows this rank holds."""

    vocab_start_idx: int
    vocab_end_idx: int
    num_embeddings: int
    embedding_dim: int


def load_replicated(layer: ShardedLayer, param: nn.Parameter, loaded_weight: torch.Tensor,
                    shard_id: object = None) -> None:
    """ReplicatedLinear: every rank copies the whole tensor."""
    check_not_packed(shard_id, "ReplicatedLinear")
    copy_checked(param.data, loaded_weight, "ReplicatedLinear")


def load_column_parallel(layer: ShardedLayer, param: nn.Parameter, loaded_weight: torch.Tensor,
                         shard_id: object = None) -> None:
    """ColumnParallelLinear: this rank's 1/tp of the output features (the rows of W; of b)."""
    check_not_packed(shard_id, type(layer).__name__)
    load_rows(param, loaded_weight, 0, param.size(0), layer.tp_rank, layer.tp_size,
              type(layer).__name__)


def load_merged_columns(layer: PackedColumns, param: nn.Parameter, loaded_weight: torch.Tensor,
                        shard_id: object = None) -> None:
    """MergedColumnParallelLinear: shard_id's matmul (0 = gate_proj, 1 = up_proj), this rank's
    1/tp of its rows, at its offset in the packed parameter."""
    if not isinstance(shard_id, int) or not 0 <= shard_id < len(layer.output_sizes):
        raise ValueError(f"MergedColumnParallelLinear needs shard_id in "
                         f"0..{len(layer.output_sizes) - 1}, got {shard_id!r}")
    offset = sum(layer.output_sizes[:shard_id]) // layer.tp_size
    load_rows(param, loaded_weight, offset, layer.output_sizes[shard_id] // layer.tp_size,
              layer.tp_rank, layer.tp_size, f"MergedColumnParallelLinear shard {shard_id}")


def load_qkv(layer: PackedHeads, param: nn.Parameter, loaded_weight: torch.Tensor,
             shard_id: object = None) -> None:
    """QKVParallelLinear: q_proj's, k_proj's or v_proj's rows (shard_id "q", "k", "v") of this
    rank's whole heads, at their place in [q heads | k heads | v heads]."""
    q_size = layer.num_heads * layer.head_size
    kv_size = layer.num_kv_heads * layer.head_size
    layout = {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}
    if shard_id not in layout:
        raise ValueError(f"QKVParallelLinear needs shard_id 'q', 'k' or 'v', got {shard_id!r}")
    offset, size = layout[shard_id]
    load_rows(param, loaded_weight, offset, size, layer.tp_rank, layer.tp_size,
              f"QKVParallelLinear shard {shard_id!r}")


def load_row_parallel(layer: ShardedLayer, param: nn.Parameter, loaded_weight: torch.Tensor,
                      shard_id: object = None) -> None:
    """RowParallelLinear: this rank's 1/tp of the input features (the columns of W)."""
    check_not_packed(shard_id, "RowParallelLinear")
    load_columns(param, loaded_weight, layer.tp_rank, layer.tp_size, "RowParallelLinear")


def load_vocab_parallel(layer: VocabRows, param: nn.Parameter, loaded_weight: torch.Tensor,
                        shard_id: object = None) -> None:
    """VocabParallelEmbedding and ParallelLMHead: this rank's rows of the vocabulary."""
    check_not_packed(shard_id, type(layer).__name__)
    load_vocab_rows(param, loaded_weight, layer.vocab_start_idx, layer.vocab_end_idx,
                    (layer.num_embeddings, layer.embedding_dim), type(layer).__name__)


def set_weight_attrs(param: nn.Parameter, attrs: dict[str, object]) -> None:
    """Attach attributes such as ``weight_loader`` to a parameter (vLLM's helper). The loader
    reads them with getattr; nn.Parameter declares none of them, hence setattr."""
    for key, value in attrs.items():
        setattr(param, key, value)


def copy_checked(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    """Copy ``src`` into ``dst`` after checking shapes (dtype/device are converted by copy_)."""
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(
            f"{what}: shape mismatch, parameter expects {tuple(dst.shape)} "
            f"but the checkpoint tensor (after sharding) is {tuple(src.shape)}"
        )
    dst.copy_(src)


def divide(numerator: int, denominator: int, what: str) -> int:
    """numerator / tensor_parallel_size, which must divide it."""
    if numerator % denominator != 0:
        raise ValueError(
            f"{what}={numerator} is not divisible by tensor_parallel_size={denominator}"
        )
    return numerator // denominator


def heads_per_rank(tp_size: int, num_heads: int, num_kv_heads: int) -> tuple[int, int]:
    """The query and the key/value heads each rank holds (whole heads: check_tp_divides_heads)."""
    check_tp_divides_heads(tp_size, num_heads, num_kv_heads)
    return num_heads // tp_size, num_kv_heads // tp_size


def check_tp_divides_heads(tp_size: int, num_heads: int, num_kv_heads: int) -> None:
    """QKVParallelLinear gives each rank whole heads, so tp_size must divide both head counts."""
    if num_heads % tp_size or num_kv_heads % tp_size:
        raise ValueError(
            f"tensor_parallel_size={tp_size} must divide both num_attention_heads={num_heads} "
            f"and num_key_value_heads={num_kv_heads} (each rank keeps whole heads)."
        )


def rank_slice(
    loaded: torch.Tensor, dim: int, full_size: int, tp_rank: int, tp_size: int, what: str
) -> torch.Tensor:
    """This rank's contiguous 1/tp slice of ``loaded`` along ``dim`` (after a full-size check)."""
    if loaded.dim() <= dim or loaded.size(dim) != full_size:
        raise ValueError(
            f"{what}: checkpoint tensor has shape {tuple(loaded.shape)}, expected size "
            f"{full_size} along dim {dim} (the full, unsharded size)"
        )
    shard = full_size // tp_size
    return loaded.narrow(dim, tp_rank * shard, shard)


def check_not_packed(shard_id: object, what: str) -> None:
    if shard_id is not None:
        raise ValueError(f"{what} is not packed, but got shard id {shard_id!r}")


def load_rows(param: nn.Parameter, loaded: torch.Tensor, offset: int, size: int,
              tp_rank: int, tp_size: int, what: str) -> None:
    """Column parallel: this rank's 1/tp of the full tensor's rows (size * tp of them) into
    param rows [offset, offset + size) (a packed layer's piece; all of them otherwise)."""
    src = rank_slice(loaded, 0, size * tp_size, tp_rank, tp_size, what)
    copy_checked(param.data.narrow(0, offset, size), src, what)


def load_columns(param: nn.Parameter, loaded: torch.Tensor, tp_rank: int, tp_size: int,
                 what: str) -> None:
    """Row parallel: this rank's 1/tp of the input features (dim 1). The bias is over OUTPUT
    features, which are not split: every rank holds it all."""
    if param.dim() == 1:
        copy_checked(param.data, loaded, f"{what} bias")
        return
    src = rank_slice(loaded, 1, param.size(1) * tp_size, tp_rank, tp_size, what)
    copy_checked(param.data, src, what)


def load_vocab_rows(param: nn.Parameter, loaded: torch.Tensor, start: int, end: int,
                    full_shape: tuple[int, int], what: str) -> None:
    """Vocabulary parallel: rows [start, end) of the full [vocab, hidden] table into param's
    first rows; the rows past them (the last rank's padding) zeroed."""
    if tuple(loaded.shape) != full_shape:
        raise ValueError(
            f"{what}: checkpoint tensor has shape {tuple(loaded.shape)}, expected "
            f"{full_shape} (vocab_size, hidden_size)"
        )
    n = end - start
    copy_checked(param.data[:n], loaded[start:end], what)
    param.data[n:].zero_()  # padding rows of the last rank
