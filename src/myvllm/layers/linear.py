"""Tensor-parallel linear layers (the Megatron split: one all-reduce per matmul pair).

    ColumnParallelLinear  W [out, in] split along dim 0: each rank a slice of the OUTPUT
    RowParallelLinear     W [out, in] split along dim 1: partial sums -> all_reduce

Parameters are built at the per-rank size; each one's weight_loader, a function of
layers/weight_loaders.py that its class names, cuts its rank's piece out of the checkpoint's
full tensor when the model is loaded. The matmul is kernels.linear, which
picks the kernel for the device and the batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from myvllm.kernels import is_batch_invariant, linear
from myvllm.layers.weight_loaders import (divide, heads_per_rank, load_column_parallel,
                                          load_merged_columns, load_qkv, load_replicated,
                                          load_row_parallel, set_weight_attrs)
from myvllm.utils.distributed import all_reduce, get_tp_rank, get_tp_size


class LinearBase(nn.Module):
    """y = x W^T (+ b) with per-rank parameter shapes; subclasses define the split, and name
    the weight_loader (layer, param, loaded_weight, shard_id=None) that cuts it."""

    weight_loader: Callable[..., None]

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.tp_rank = get_tp_rank()
        self.tp_size = get_tp_size()
        # Local (per-rank) sizes: subclasses divide before calling us.
        self.input_size = input_size
        self.output_size = output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size))
        set_weight_attrs(self.weight, {"weight_loader": self.weight_loader})
        if bias:
            self.bias: nn.Parameter | None = nn.Parameter(torch.empty(output_size))
            set_weight_attrs(self.bias, {"weight_loader": self.weight_loader})
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return (f"in={self.input_size}, out={self.output_size}, bias={self.bias is not None}, "
                f"tp={self.tp_rank}/{self.tp_size}")


class ReplicatedLinear(LinearBase):
    """Every rank holds the whole weight."""

    weight_loader = load_replicated


class ColumnParallelLinear(LinearBase):
    """Output features split over ranks (dim 0 of W); the output stays sharded."""

    weight_loader = load_column_parallel

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        tp_size = get_tp_size()
        super().__init__(input_size, divide(output_size, tp_size, "output_size"), bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel matmuls of the same input packed into one (gate_proj + up_proj).

    Per rank, each logical output keeps its own slice, side by side (tp=2, [I, I]):

        full:    gate [I]          | up [I]
        rank 0:  gate[0:I/2]       | up[0:I/2]        <- param rows [0:I/2] and [I/2:I]
        rank 1:  gate[I/2:I]       | up[I/2:I]

    shard_id is the index into ``output_sizes`` (0 = gate_proj, 1 = up_proj).
    """

    weight_loader = load_merged_columns

    def __init__(self, input_size: int, output_sizes: Sequence[int], bias: bool = False) -> None:
        tp_size = get_tp_size()
        for i, size in enumerate(output_sizes):
            divide(size, tp_size, f"output_sizes[{i}]")
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(self.output_sizes), bias)


class QKVParallelLinear(ColumnParallelLinear):
    """q_proj, k_proj and v_proj packed into one matmul, split over ranks by WHOLE heads.

    Each rank keeps num_heads/tp query heads and num_kv_heads/tp key/value heads, so attention
    runs locally with no communication; its rows are [q heads | k heads | v heads] of rank r
    (the guide's Step 1 draws them). shard_id is "q", "k" or "v".
    """

    weight_loader = load_qkv

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int,
                 total_num_kv_heads: int | None = None, bias: bool = False) -> None:
        tp_size = get_tp_size()
        total_num_kv_heads = total_num_heads if total_num_kv_heads is None else total_num_kv_heads
        self.head_size = head_size
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads
        self.num_heads, self.num_kv_heads = heads_per_rank(tp_size, total_num_heads,
                                                           total_num_kv_heads)
        output_size = (total_num_heads + 2 * total_num_kv_heads) * head_size
        super().__init__(hidden_size, output_size, bias)


class RowParallelLinear(LinearBase):
    """Input features split over ranks (dim 1 of W); partial outputs summed by all_reduce."""

    weight_loader = load_row_parallel

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        tp_size = get_tp_size()
        super().__init__(divide(input_size, tp_size, "input_size"), output_size, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Add the bias on one rank only, or the all_reduce would add it tp times.
        y = linear(x, self.weight, self.bias if self.tp_rank == 0 else None)
        if self.tp_size > 1:
            y = all_reduce(y, in_rank_order=is_batch_invariant())
        return y
