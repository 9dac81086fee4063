"""worker/staging.py, static_buffers.py, token_pool.py and padded_steps.py: how a step's
host arrays reach the device (run on the CPU; pinned memory and events are GPU-only and exercised by
tests/gpu/test_gpu.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from myvllm.worker.padded_steps import PaddedSteps
from myvllm.worker.pending_tokens import input_ids, token_index
from myvllm.worker.staging import FreshTensors, block_table_array
from myvllm.worker.static_buffers import PinnedSlots, StaticBuffers
from myvllm.worker.token_pool import TokenPool

CPU = torch.device("cpu")
FIELDS = {"a": (torch.int64, 4), "b": (torch.int64, 6), "c": (torch.int32, 4),
          "t": (torch.float32, 3), "d": (torch.int32, 8)}


def test_static_fields_hold_what_was_staged_at_fixed_places() -> None:
    buffers = StaticBuffers(FIELDS, CPU)
    buffers.stage({"a": np.array([1, 2], dtype=np.int64),
                   "t": np.array([0.5, 1.5], dtype=np.float32),
                   "d": np.array([[7, 8], [9, -1]], dtype=np.int32)})
    a, t = buffers.field("a", 2), buffers.field("t", 2)
    assert a.tolist() == [1, 2] and t.tolist() == [0.5, 1.5]
    assert buffers.field("d", 4).view(2, 2).tolist() == [[7, 8], [9, -1]]
    assert t.dtype == torch.float32
    # A later step writes into the same memory (the other host slot): what a graph reads.
    buffers.stage({"a": np.array([5, 6], dtype=np.int64)})
    assert a.tolist() == [5, 6]
    # Fields of one buffer never overlap.
    storages = {n: buffers.field(n).untyped_storage().data_ptr() for n in FIELDS}
    assert len(set(storages.values())) == 2  # an int64 buffer and an int32 one
    for kind in ("a", "b"), ("c", "t", "d"):
        ranges = sorted(buffers.offset[n] for n in kind)
        assert all(e <= s for (_, e), (s, _) in zip(ranges, ranges[1:]))


def test_static_fields_refuse_more_values_than_they_hold() -> None:
    buffers = StaticBuffers(FIELDS, CPU)
    with pytest.raises(ValueError, match="c: 5 values, the field holds 4"):
        buffers.stage({"c": np.zeros(5, dtype=np.int32)})


def test_span_covers_two_neighbouring_fields() -> None:
    buffers = StaticBuffers(FIELDS, CPU)
    buffers.stage({"a": np.array([1, 2, 3, 4]), "b": np.array([5])})
    assert buffers.span("a", "b")[:5].tolist() == [1, 2, 3, 4, 5]


def test_fresh_tensors_keep_each_arrays_dtype() -> None:
    fresh = FreshTensors(CPU)
    x = fresh.tensor(np.array([1, 2, 3], dtype=np.int64), torch.int32)
    assert x.tolist() == [1, 2, 3] and x.dtype == torch.int32
    assert fresh.tensor([4], torch.int64).dtype == torch.int64
    assert fresh.tensor([0.5], torch.float32).tolist() == [0.5]


def test_block_table_array_pads_with_minus_one() -> None:
    assert block_table_array([[3], [4, 5]], width=3).tolist() == [[3, -1, -1], [4, 5, -1]]


def test_pending_tokens_are_read_from_the_pool() -> None:
    """token_index < pool size points into the pool (a pending token)."""
    pool = TokenPool(torch.tensor([7, 8, 9, 6]))
    index = token_index(pool.size, 3, [(0, 2), (2, 0)])
    assert index.tolist() == [2, 5, 0]
    ids = input_ids(pool, FreshTensors(torch.device("cpu")), [0, 101, 0], [(0, 2), (2, 0)])
    assert ids.tolist() == [9, 101, 7]


def test_sampled_tokens_are_kept_before_the_next_step() -> None:
    class Seq:
        sampled_row = None

    pool = TokenPool(torch.tensor([1, 2, 3, 4]))
    seqs = [Seq(), Seq()]
    first = pool.read_back(seqs)  # type: ignore[arg-type]
    pool.tokens.copy_(torch.tensor([5, 6, 7, 8]))  # the next step samples
    assert first.token_ids() == [1, 2] and [s.sampled_row for s in seqs] == [0, 1]


def test_a_read_back_slot_taken_by_a_later_step_refuses_to_be_read() -> None:
    """The two alternating host slots (a GPU's read-back and staging): a step's copy is
    readable until two more have been queued, then its slot holds another step's."""
    slots = PinnedSlots({torch.int64: 4}, on_gpu=False)
    first = slots.copy_to_host(torch.tensor([1, 2]))
    second = slots.copy_to_host(torch.tensor([3, 4, 5]))
    slots.wait_for(*first[1:])
    assert first[0].tolist() == [1, 2] and second[0].tolist() == [3, 4, 5]
    slots.copy_to_host(torch.tensor([6]))  # the third copy takes the first one's slot
    slots.wait_for(*second[1:])
    with pytest.raises(RuntimeError, match="overwritten"):
        slots.wait_for(*first[1:])


def test_padded_decode_rows_store_and_attend_nothing() -> None:
    padded = PaddedSteps(max_num_seqs=8, max_width=4, max_chunk_tokens=64, chunk_tiles=None,
                         device=CPU)
    padded.pool.tokens.copy_(torch.arange(50, 58))
    step = padded.decode([11, 0, 13], [(1, 5)], [3, 4, 5], [30, 40, 50], [4, 5, 6],
                         [0.0, 0.5, 1.0], [[1], [2, 3], [4]])
    assert step.input_ids.tolist() == [11, 55, 13, 0]  # padded to the graph size 4
    assert step.context.slot_mapping.tolist() == [30, 40, 50, -1]
    assert step.context.context_lens.tolist() == [4, 5, 6, 0]
    assert step.context.block_tables.tolist() == [[1, -1, -1, -1], [2, 3, -1, -1],
                                                  [4, -1, -1, -1], [-1, -1, -1, -1]]
    assert step.temperatures.tolist() == [0.0, 0.5, 1.0, 0.0]
    # The same shape always reads the same memory (what its graph was captured on).
    other = padded.decode_inputs(4)
    assert other.input_ids.data_ptr() == step.input_ids.data_ptr()
    assert other.context.block_tables.data_ptr() == step.context.block_tables.data_ptr()


@pytest.mark.slow  # a fresh interpreter imports torch and builds an engine (~8 s)
def test_building_an_engine_imports_no_triton() -> None:
    """Triton is imported on first use of a kernel, so a machine without it (no Linux wheel)
    runs the references: the engine's modules, padded steps included, must not import it."""
    import subprocess
    import sys

    code = ("import sys; import myvllm.engine.llm_engine, myvllm.worker.padded_steps; "
            "import myvllm.worker.cuda_graphs; "
            "assert 'triton' not in sys.modules, 'triton was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_block_tables_are_written_straight_into_their_field() -> None:
    buffers = StaticBuffers(FIELDS, CPU)
    buffers.stage({}, tables={"d": ([[3], [4, 5]], 2, 4)})
    buffers.stage({}, tables={"d": ([[7, 8, 9]], 2, 4)})  # the other host slot
    assert buffers.field("d", 8).view(2, 4).tolist() == [[7, 8, 9, -1],
                                                         [-1, -1, -1, -1]]  # no row left over
