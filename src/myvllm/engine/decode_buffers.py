"""The fixed memory a decode step reads and writes: no allocation per step, two copies in.

A decode step needs a handful of small per-sequence inputs. Built as fresh tensors each step,
that is five pinned host allocations, five host-to-device copies and (for a CUDA graph) five
device copies into the graph's static inputs. Here they live in two device buffers that
never move, so a captured graph reads them in place, and one pinned host copy of each, so a
step is filled with numpy writes and sent with two copies:

    int64 device buffer (size 4 * max_bs):
        [ sampled (max_bs) | host ids (bs) | positions (bs) | token_index (bs) | unused ]
    int32 device buffer:
        [ slot_mapping (bs) | context_lens (bs) | temperatures (bs) | block_tables (bs x width) ]

    (bs is the step's padded batch size; temperatures are float32 stored in int32 slots.)

`sampled` is the token pool: every step's sampled tokens are written there (by the CUDA
graph itself, or by ModelRunner.run). A sequence whose last token is still pending
(overlapped scheduling) reads it from there without a round trip to the host:

    input_ids = int64_buffer[token_index]      token_index[row] = max_bs + row   known id
                                               token_index[row] = r              pending: row r
                                                                                 of the pool

Double buffering: with overlapped scheduling the host fills step N+1 while step N's copies
may still wait in the stream behind step N-1, so the host side has two slots that alternate;
an event per slot says when its last copy is done (it nearly always is).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# Fields of the int64 buffer after the sampled-token pool, and of the int32 buffer before
# the block tables, in order; each is bs entries long.
INT64_FIELDS = ("input_ids_host", "positions", "token_index")
INT32_FIELDS = ("slot_mapping", "context_lens", "temperatures")
N64, N32 = len(INT64_FIELDS), len(INT32_FIELDS)
MAX_CACHED_VIEWS = 256


@dataclass
class DecodeViews:
    """Views of the device buffers for one (padded batch size, block-table width)."""

    input_ids: torch.Tensor  # [bs] int64, gathered by DecodeBuffers.copy_in
    input_ids_host: torch.Tensor  # [bs] int64, ids known on the host
    positions: torch.Tensor  # [bs] int64
    token_index: torch.Tensor  # [bs] int64, see the module docstring
    slot_mapping: torch.Tensor  # [bs] int32, -1 = padding row, store nothing
    context_lens: torch.Tensor  # [bs] int32, 0 = padding row, attend to nothing
    temperatures: torch.Tensor  # [bs] float32, 0 = greedy
    block_tables: torch.Tensor  # [bs, width] int32, -1 past a sequence's blocks
    sampled: torch.Tensor  # [bs] int64, this step's tokens (the pool's first bs rows)


class DecodeBuffers:
    def __init__(self, max_batch_size: int, max_width: int, device: torch.device,
                 pin_memory: bool) -> None:
        self.max_bs = max_batch_size
        self.max_width = max_width
        int64_size = (1 + N64) * max_batch_size
        int32_size = (N32 + max_width) * max_batch_size
        self.int64 = torch.zeros(int64_size, dtype=torch.int64, device=device)
        self.int32 = torch.zeros(int32_size, dtype=torch.int32, device=device)
        # input_ids is written by a gather (index_select), so it cannot be a view of the
        # buffer it gathers from.
        self.input_ids = torch.zeros(max_batch_size, dtype=torch.int64, device=device)
        self.host_int64 = [torch.zeros(int64_size - max_batch_size, dtype=torch.int64,
                                       pin_memory=pin_memory) for _ in range(2)]
        self.host_int32 = [torch.zeros(int32_size, dtype=torch.int32, pin_memory=pin_memory)
                           for _ in range(2)]
        # numpy views of the same host memory: filled element-wise without torch overhead.
        self.host_int64_np = [t.numpy() for t in self.host_int64]
        self.host_int32_np = [t.numpy() for t in self.host_int32]
        self.copied = [torch.cuda.Event() if pin_memory else None for _ in range(2)]
        self.slot = 0  # the host slot the next fill uses
        # Sampled tokens come back through two alternating pinned slots as well.
        self.host_sampled = [torch.zeros(max_batch_size, dtype=torch.int64, pin_memory=pin_memory)
                             for _ in range(2)]
        self.sampled_copied = [torch.cuda.Event() if pin_memory else None for _ in range(2)]
        self.read_slot = 0
        self.steps_read = 0
        self.read_owner = [0, 0]  # which read_back call each slot holds now
        self._views: dict[tuple[int, int], DecodeViews] = {}  # built once per shape

    @property
    def sampled(self) -> torch.Tensor:
        """The token pool [max_bs] int64: the last step's tokens, row by row."""
        return self.int64[: self.max_bs]

    def views(self, bs: int, width: int) -> DecodeViews:
        """The device views a step of bs rows and block tables `width` wide reads.

        They depend only on (bs, width), so a graph captured with them reads what every
        later step of that shape writes. They are kept for reuse, up to MAX_CACHED_VIEWS
        shapes: on a GPU the graph sizes are a few dozen, but an unpadded CPU run meets one
        shape per (batch, table width) and would keep every one for as long as it serves.
        Views rebuilt later cover the same memory, so dropping them changes nothing else.
        """
        cached = self._views.get((bs, width))
        if cached is not None:
            return cached
        if not 1 <= bs <= self.max_bs or not 1 <= width <= self.max_width:
            raise ValueError(f"decode step of {bs} rows x {width} blocks; the buffers hold "
                             f"1..{self.max_bs} rows x 1..{self.max_width} blocks")
        pool = self.max_bs
        ids, positions, index = (self.int64[pool + i * bs: pool + (i + 1) * bs]
                                 for i in range(N64))
        slots, lens, temps = (self.int32[i * bs: (i + 1) * bs] for i in range(N32))
        tables = self.int32[N32 * bs: (N32 + width) * bs].view(bs, width)
        views = DecodeViews(self.input_ids[:bs], ids, positions, index, slots, lens,
                            temps.view(torch.float32), tables, self.int64[:bs])
        if len(self._views) >= MAX_CACHED_VIEWS:
            self._views.clear()
        self._views[(bs, width)] = views
        return views

    def copy_in(self, bs: int, width: int, int64_rows: list[list[int]],
                int32_rows: list[list[int]], temperatures: list[float],
                block_tables: list[list[int]]) -> DecodeViews:
        """Write one step's values (each list bs long) to the host slot, send them to the
        device, gather input_ids; returns the views. Nothing here waits for the device."""
        slot, self.slot = self.slot, 1 - self.slot
        event = self.copied[slot]
        if event is not None:
            event.synchronize()  # the copy two steps ago out of this slot (long done)
        host64 = self.host_int64_np[slot]
        host32 = self.host_int32_np[slot]
        for i, values in enumerate(int64_rows):
            host64[i * bs: (i + 1) * bs] = values
        for i, values in enumerate(int32_rows):
            host32[i * bs: (i + 1) * bs] = values
        host32[(N32 - 1) * bs: N32 * bs].view(np.float32)[:] = temperatures  # the last field
        tables = host32[N32 * bs: (N32 + width) * bs].reshape(bs, width)
        tables.fill(-1)
        for row, table in enumerate(block_tables):
            tables[row, : len(table)] = table
        n64, n32 = N64 * bs, (N32 + width) * bs
        non_blocking = event is not None
        self.int64[self.max_bs: self.max_bs + n64].copy_(self.host_int64[slot][:n64],
                                                         non_blocking=non_blocking)
        self.int32[:n32].copy_(self.host_int32[slot][:n32], non_blocking=non_blocking)
        if event is not None:
            event.record()
        views = self.views(bs, width)
        torch.index_select(self.int64, 0, views.token_index, out=views.input_ids)
        return views

    # ------------------------------------------------------------------ tokens back to the host
    def read_back(self, num_seqs: int) -> SampledTokens:
        """Queue the copy of the pool's first num_seqs tokens to the host; returns at once."""
        slot = self.read_slot
        self.read_slot = 1 - slot
        self.steps_read += 1
        self.read_owner[slot] = self.steps_read
        host = self.host_sampled[slot][:num_seqs]
        event = self.sampled_copied[slot]
        host.copy_(self.int64[:num_seqs], non_blocking=event is not None)
        if event is not None:
            event.record()
        return SampledTokens(host, event, self.read_owner, slot, self.steps_read)


class SampledTokens:
    """The token ids of one step, on their way from the device to the host.

    ModelRunner.run returns as soon as the step is queued; token_ids() waits for the copy.
    Between the two the host can plan the next step (overlapped scheduling, see
    EngineCore.step). The host memory is one of two slots that alternate, so a step's tokens
    must be read before two more steps are run; reading them later raises (the engine reads
    each step right after queuing the next).
    """

    def __init__(self, host: torch.Tensor, copied: torch.cuda.Event | None,
                 owner: list[int], slot: int, step: int) -> None:
        self.host, self.copied = host, copied
        self._owner, self._slot, self._step = owner, slot, step

    def token_ids(self) -> list[int]:
        if self._owner[self._slot] != self._step:
            raise RuntimeError("these sampled tokens were overwritten: read a step's tokens "
                               "before running two more steps")
        if self.copied is not None:
            self.copied.synchronize()
        return self.host.tolist()
