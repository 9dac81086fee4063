"""Staging: one step's host arrays become the device tensors its forward pass reads.

The InputBuilder computes a step's inputs on the host as named numpy arrays (token ids,
positions, slots, ...). A staging object sends them to the device:

    FreshTensors    a new tensor per array and step. On a CPU that is all there is (the
                    "device" is the host). On a GPU, for steps too large for a CUDA graph,
                    each array goes through pinned memory with a non_blocking copy, so the
                    host does not wait for the device.
    StaticBuffers   GPU only: every field has a fixed place in one of two device buffers
                    (int64, and int32, which also holds the float32 fields). A CUDA graph
                    captured on these places reads each later step's values in place, with
                    no copy of its own. The host writes a step into one of two pinned slots
                    (they alternate, so it can fill step N+1 while step N's copy may still
                    wait in the stream) and sends each buffer with one copy per run of
                    written fields.

    fresh.tensor(positions, torch.int64)              # one array -> one new device tensor
    static.stage({"positions": np.array([4, 5, 6]), ...})
    static.field("positions", 3)                       # its place on the device, int64 [3]
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import torch

NUMPY_DTYPES = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32}
# Fields of a StaticBuffers written in one step are sent as one copy when less than this many
# elements lie unwritten between them (a copy costs microseconds; 16 KiB costs less).
MERGE_GAP = 4096


class FreshTensors:
    """New tensors every step (a CPU; a GPU step that no graph replays)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pin_memory = device.type == "cuda"

    def tensor(self, values: np.ndarray | list[int] | list[float], dtype: torch.dtype
               ) -> torch.Tensor:
        """One host array on the device, without making the host wait. Through numpy:
        torch.tensor() of a long Python list is ~3x slower (a 32k-token chunk's ids,
        positions and slots took ~7 ms on the development machine)."""
        host = torch.from_numpy(np.asarray(values, dtype=NUMPY_DTYPES[dtype]))
        if not self.pin_memory:
            return host.to(self.device)
        return host.pin_memory().to(self.device, non_blocking=True)


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
        pin = device.type == "cuda"
        self.host_slots = [{kind: torch.zeros_like(buffer, device="cpu", pin_memory=pin)
                            for kind, buffer in self.device_buffers.items()} for _ in range(2)]
        # numpy views of the host slots, made once: a .numpy() per field and step cost
        # ~10 us each, a tenth of a padded step's staging.
        self.host_arrays = [{kind: host.numpy() for kind, host in slot.items()}
                            for slot in self.host_slots]
        self.copied = [torch.cuda.Event() if pin else None for _ in range(2)]
        self.slot = 0  # the host slot the next stage() fills

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
        slot, self.slot = self.slot, 1 - self.slot
        event = self.copied[slot]
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
            else:
                block_table_array(values, shape[1], shape[0],
                                  out=host[start: start + size].reshape(shape))
            written[kind].append((start, start + size))
        for kind, extents in written.items():
            for start, end in _merge(extents):
                self.device_buffers[kind][start:end].copy_(
                    self.host_slots[slot][kind][start:end], non_blocking=event is not None)
        if event is not None:
            event.record()


def block_table_array(tables: list[list[int]], width: int, num_rows: int | None = None,
                      out: np.ndarray | None = None) -> np.ndarray:
    """Block tables as an int32 rectangle [num_rows (default: one per table), width], -1
    past each table's end (the kernels never read past a sequence's context); written into
    out when given."""
    shape = (len(tables) if num_rows is None else num_rows, width)
    if out is None:
        array = np.full(shape, -1, dtype=np.int32)
    else:
        array = out
        array.fill(-1)
    for row, table in enumerate(tables):
        array[row, : len(table)] = table
    return array


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

