"""For the batch-invariant tests on a CPU: Triton's interpreter with the GPU's dot semantics.

The interpreter computes tl.dot with numpy.matmul, that is with the CPU's BLAS, and its
result for a row depends on where that row sits in the tile (measured: a row of a 16 x 16
float32 product moved to another place in the tile gives other bits). A GPU's matrix unit
sums each output element in a fixed order from its own row and column only, which is what
the batch-invariant kernels rely on. fixed_order_dot gives the interpreter that property: the
products are summed k = 0, 1, 2, ... for every element, the same work for every row.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any



def fixed_order_dot(self: Any, a: Any, b: Any, d: Any, input_precision: Any,
                    max_num_imprecise_acc: Any) -> Any:
    """InterpreterBuilder.create_dot, summing over k in order for every output element."""
    from triton.runtime.interpreter import TensorHandle

    out_dtype = d.data.dtype
    a_data, b_data = a.data.astype(out_dtype), b.data.astype(out_dtype)
    acc = d.data.copy()
    for k in range(a_data.shape[-1]):
        acc = acc + a_data[..., :, k, None] * b_data[..., None, k, :]
    return TensorHandle(acc.astype(out_dtype), d.dtype.scalar)


@contextmanager
def gpu_like_dot() -> Iterator[None]:
    """Inside the block, the interpreter's tl.dot is fixed_order_dot (no-op on a GPU)."""
    import torch

    if torch.cuda.is_available():
        yield
        return
    from triton.runtime.interpreter import InterpreterBuilder

    original = InterpreterBuilder.create_dot
    InterpreterBuilder.create_dot = fixed_order_dot  # type: ignore[method-assign]
    try:
        yield
    finally:
        InterpreterBuilder.create_dot = original  # type: ignore[method-assign]


@contextmanager
def batch_invariant(enabled: bool = True) -> Iterator[None]:
    """The process-wide mode on for the block, restored after."""
    from myvllm.kernels import is_batch_invariant, set_batch_invariant

    before = is_batch_invariant()
    set_batch_invariant(enabled)
    try:
        yield
    finally:
        set_batch_invariant(before)
