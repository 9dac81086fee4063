"""GPU staging: a step's fields at fixed places in device memory, for CUDA graphs.

StaticBuffers: every field has a fixed place in one of two device buffers (int64, and int32,
which also holds the float32 fields). A CUDA graph captured on these places reads each later
step's values in place, with no copy of its own. The host writes a step into one of two
pinned slots (they alternate, so it can fill step N+1 while step N's copy may still wait in
the stream) and sends each buffer with one copy per run of written fields.

    static.stage({"positions": np.array([4, 5, 6]), ...})
    static.field("positions", 3)                       # its place on the device, int64 [3]

The two alternating pinned slots are PinnedSlots, used both ways: StaticBuffers stages each
step through them, and the sampled-token pool (worker/token_pool.py) reads each step's tokens
back through them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import torch


# Fields of a StaticBuffers written in one step are sent as one copy when less than this many
# elements lie unwritten between them (a copy costs microseconds; 16 KiB costs less).
MERGE_GAP = 4096


class StaticBuffers:
    """Named fields at fixed places in device memory, filled from two pinned host slots."""

    def __init__(self, fields: Mapping[str, tuple[torch.dtype, int]], device: torch.device
                 ) -> None:
        """fields: name -> (dtype, most elements), in the order they are laid out."""
        self.dtypes = {name: dtype for name, (dtype, _) in fields.items()}
        self.offset: dict[str, tuple[int, int]] = {}  # name -> (start, end) in its buffer
        ends = {torch.int64: 0, torch.int32: 0}
        for name, (dtype, size) in fields.items():
            kind = _buffer_kind(dtype)
            self.offset[name] = (ends[kind], ends[kind] + size)
            ends[kind] += size
        self.device_buffers = {kind: torch.zeros(max(end, 1), dtype=kind, device=device)
                               for kind, end in ends.items()}
        self.host_slots = PinnedSlots({kind: max(end, 1) for kind, end in ends.items()},
                                      on_gpu=device.type == "cuda")
        # numpy views of the host slots, made once: a .numpy() per field and step cost
        # ~10 us each, a tenth of a padded step's staging.
        self.host_arrays = [{kind: host.numpy() for kind, host in slot.items()}
                            for slot in self.host_slots.buffers]

    def field(self, name: str, n: int | None = None) -> torch.Tensor:
        """The device view of a field's first n elements (all of it when n is None)."""
        start, end = self.offset[name]
        view = self.device_buffers[_buffer_kind(self.dtypes[name])][start:end]
        if self.dtypes[name] == torch.float32:
            view = view.view(torch.float32)
        return view if n is None else view[:n]

    def span(self, first: str, last: str) -> torch.Tensor:
        """The device memory from field `first` to field `last`, both included (two fields
        of one buffer laid out one after the other)."""
        kind = _buffer_kind(self.dtypes[first])
        assert kind == _buffer_kind(self.dtypes[last])
        return self.device_buffers[kind][self.offset[first][0]: self.offset[last][1]]

    def stage(self, arrays: Mapping[str, np.ndarray],
              tables: Mapping[str, tuple[list[list[int]], int, int]] | None = None) -> None:
        """Write each array at the start of its field, and each entry of tables (block tables,
        rows, width) as a -1 padded rectangle straight into the host slot (no array of its
        own: at 256 rows and a long context it is megabytes a step); send what was written.
        The step reads it through field() views, the same memory at every step.
        Stream-ordered: a step still running on the buffers has read them before these
        copies land."""
        slot = self.host_slots.next_slot()
        event = self.host_slots.events[slot]
        if event is not None:
            event.synchronize()  # the copy two steps ago out of this slot (long done)
        written: dict[torch.dtype, list[tuple[int, int]]] = {torch.int64: [], torch.int32: []}
        fields: list[tuple[str, tuple[int, ...], np.ndarray | list[list[int]]]] = [
            (name, array.shape, array) for name, array in arrays.items()]
        fields += [(name, (rows, width), table_rows)
                   for name, (table_rows, rows, width) in (tables or {}).items()]
        for name, shape, values in fields:
            size = math.prod(shape)
            start, end = self.offset[name]
            if size > end - start:
                raise ValueError(f"{name}: {size} values, the field holds {end - start}")
            kind = _buffer_kind(self.dtypes[name])
            host = self.host_arrays[slot][kind]
            if self.dtypes[name] == torch.float32:
                host = host.view(np.float32)
            if isinstance(values, np.ndarray):
                host[start: start + size] = values.reshape(-1)
            else:  # block tables: -1 past each table's end, as block_table_array's
                rectangle = host[start: start + size].reshape(shape)
                rectangle.fill(-1)
                for row, table in enumerate(values):
                    rectangle[row, : len(table)] = table
            written[kind].append((start, start + size))
        for kind, extents in written.items():
            for start, end in _merge(extents):
                self.device_buffers[kind][start:end].copy_(
                    self.host_slots.buffers[slot][kind][start:end], non_blocking=event is not None)
        if event is not None:
            event.record()


class PinnedSlots:
    """Two host copies of the same buffers, used in turn. On a GPU they are pinned and each
    has an event, recorded after the device's copy into or out of it: the host fills (or
    reads) one slot while the copy of the other may still wait in the stream."""

    def __init__(self, sizes: Mapping[torch.dtype, int], on_gpu: bool) -> None:
        self.buffers = [{dtype: torch.zeros(size, dtype=dtype, pin_memory=on_gpu)
                         for dtype, size in sizes.items()} for _ in range(2)]
        self.events = [torch.cuda.Event() if on_gpu else None for _ in range(2)]
        self.turns = 0  # slots handed out so far
        self.owner = [0, 0]  # the turn whose data each slot holds

    def next_slot(self) -> int:
        """The slot for the next use (they alternate); the last but one use's is gone."""
        slot = self.turns % 2
        self.turns += 1
        self.owner[slot] = self.turns
        return slot

    def copy_to_host(self, source: torch.Tensor) -> tuple[torch.Tensor, int, int]:
        """Queue the copy of a 1-D int64 device tensor into the next slot; returns (its host
        view, the slot, the turn) at once. wait_for(slot, turn) before reading the view."""
        slot = self.next_slot()
        host = self.buffers[slot][torch.int64][:source.numel()]
        event = self.events[slot]
        host.copy_(source, non_blocking=event is not None)
        if event is not None:
            event.record()
        return host, slot, self.turns

    def wait_for(self, slot: int, turn: int) -> None:
        """Wait until the copy of that turn has landed; raise if a later one took its slot."""
        if self.owner[slot] != turn:
            raise RuntimeError("these sampled tokens were overwritten: read a step's tokens "
                               "before running two more steps")
        event = self.events[slot]
        if event is not None:
            event.synchronize()


def _buffer_kind(dtype: torch.dtype) -> torch.dtype:
    """The device buffer a field of this dtype lives in (float32 shares the int32 one)."""
    return torch.int64 if dtype == torch.int64 else torch.int32


def _merge(extents: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Written (start, end) ranges -> the ranges to copy, near neighbours joined."""
    runs: list[tuple[int, int]] = []
    for start, end in sorted(e for e in extents if e[1] > e[0]):
        if runs and start - runs[-1][1] < MERGE_GAP:
            runs[-1] = (runs[-1][0], max(end, runs[-1][1]))
        else:
            runs.append((start, end))
    return runs

