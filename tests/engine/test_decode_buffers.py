"""engine/decode_buffers.py: the fixed memory of a decode step (run on the CPU; the GPU-only
parts, pinned memory and events, are exercised by tests/gpu/test_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from myvllm.engine.decode_buffers import DecodeBuffers

CPU = torch.device("cpu")


def fill(buffers: DecodeBuffers, bs: int, width: int, token_index: list[int] | None = None,
         base: int = 0):
    rows = range(bs)
    return buffers.copy_in(
        bs, width,
        [[base + 100 + r for r in rows], [base + 10 + r for r in rows],
         token_index or [buffers.max_bs + r for r in rows]],
        [[base + 20 + r for r in rows], [base + 30 + r for r in rows]],
        [0.5 * r for r in rows],
        [[base + r] * min(r + 1, width) for r in rows],
    )  # fmt: skip


def test_views_hold_what_was_copied_in_and_never_overlap() -> None:
    buffers = DecodeBuffers(max_batch_size=4, max_width=3, device=CPU, pin_memory=False)
    views = fill(buffers, bs=3, width=3)
    assert views.input_ids.tolist() == [100, 101, 102]  # every row reads its host id
    assert views.positions.tolist() == [10, 11, 12]
    assert views.slot_mapping.tolist() == [20, 21, 22]
    assert views.context_lens.tolist() == [30, 31, 32]
    assert views.temperatures.tolist() == [0.0, 0.5, 1.0]
    assert views.block_tables.tolist() == [[0, -1, -1], [1, 1, -1], [2, 2, 2]]
    # Different fields are different memory, and a shape always maps to the same memory
    # (what a CUDA graph captured on it reads at every later step).
    spans = []
    for t in (views.input_ids_host, views.positions, views.token_index, views.sampled,
              views.slot_mapping, views.context_lens, views.temperatures, views.block_tables):
        spans.append((t.untyped_storage().data_ptr(), t.data_ptr(),
                      t.data_ptr() + t.numel() * t.element_size()))
    for i, (storage_a, start_a, end_a) in enumerate(spans):
        for storage_b, start_b, end_b in spans[i + 1:]:
            assert storage_a != storage_b or end_a <= start_b or end_b <= start_a
    again = buffers.views(3, 3)
    assert again.block_tables.data_ptr() == views.block_tables.data_ptr()
    assert again.temperatures.data_ptr() == views.temperatures.data_ptr()


def test_pending_rows_read_the_last_sampled_tokens() -> None:
    """token_index < max_bs points into the pool of sampled tokens (a pending token)."""
    buffers = DecodeBuffers(max_batch_size=4, max_width=2, device=CPU, pin_memory=False)
    buffers.sampled.copy_(torch.tensor([7, 8, 9, 6]))  # what the last step sampled
    views = fill(buffers, bs=3, width=2, token_index=[2, 4 + 1, 0])
    assert views.input_ids.tolist() == [9, 101, 7]


def test_later_steps_overwrite_values_in_place() -> None:
    buffers = DecodeBuffers(max_batch_size=4, max_width=3, device=CPU, pin_memory=False)
    first = fill(buffers, bs=2, width=3)
    second = fill(buffers, bs=2, width=3, base=1000)  # the other host slot
    assert first.slot_mapping.data_ptr() == second.slot_mapping.data_ptr()
    assert second.slot_mapping.tolist() == [1020, 1021]
    assert second.block_tables.tolist() == [[1000, -1, -1], [1001, 1001, -1]]
    third = fill(buffers, bs=4, width=1, base=2000)  # another shape: another layout
    assert third.positions.tolist() == [2010, 2011, 2012, 2013]


def test_shapes_outside_the_buffers_are_refused() -> None:
    buffers = DecodeBuffers(max_batch_size=4, max_width=3, device=CPU, pin_memory=False)
    for bs, width in ((5, 3), (0, 3), (4, 4)):
        with pytest.raises(ValueError, match="the buffers hold 1..4 rows x 1..3 blocks"):
            buffers.views(bs, width)


def test_sampled_tokens_must_be_read_before_two_more_steps() -> None:
    buffers = DecodeBuffers(max_batch_size=4, max_width=1, device=CPU, pin_memory=False)
    buffers.sampled.copy_(torch.tensor([1, 2, 3, 4]))
    first = buffers.read_back(2)
    buffers.sampled.copy_(torch.tensor([5, 6, 7, 8]))
    second = buffers.read_back(3)
    assert first.token_ids() == [1, 2] and second.token_ids() == [5, 6, 7]
    buffers.read_back(1)  # reuses first's host slot
    with pytest.raises(RuntimeError, match="overwritten"):
        first.token_ids()
    assert second.token_ids() == [5, 6, 7]


def test_the_view_cache_stays_bounded_and_views_keep_their_memory() -> None:
    """A CPU run is not padded: every (batch, width) is a new shape. The cache of views must
    not grow with them (a long-running server), and a view rebuilt after the cache was
    dropped covers the same memory as before (what a captured graph relies on)."""
    from myvllm.engine.decode_buffers import MAX_CACHED_VIEWS

    buffers = DecodeBuffers(max_batch_size=64, max_width=64, device=torch.device("cpu"),
                            pin_memory=False)
    first = buffers.views(3, 5)
    for bs in range(1, 65):
        for width in range(1, 65):
            buffers.views(bs, width)
    assert len(buffers._views) <= MAX_CACHED_VIEWS
    again = buffers.views(3, 5)
    assert again is not first  # rebuilt...
    assert again.block_tables.data_ptr() == first.block_tables.data_ptr()  # ...same memory
    assert again.slot_mapping.data_ptr() == first.slot_mapping.data_ptr()


def test_building_an_engine_imports_no_triton() -> None:
    """Triton is imported on first use of a kernel, so a machine without it (no Linux wheel)
    runs the references: the engine's modules, chunked-step buffers included, must not
    import it themselves."""
    import subprocess
    import sys

    code = ("import sys; import myvllm.engine.llm_engine, myvllm.engine.chunk_graphs; "
            "assert 'triton' not in sys.modules, 'triton was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
