"""Step 5b: CUDA graphs of chunked-prefill steps (prompt chunks and decode rows together).

A chunked-prefill step has a new shape at every step (how many decode rows, which chunks),
so run eagerly it pays Python's price for launching some 300 kernels (28 layers of the
Qwen3-0.6B shape) whatever the GPU has to do: tens of milliseconds, where a step of a few
hundred tokens keeps the GPU busy for a few. Every decoding stream waits for that step.
Three things make such a step replayable from a CUDA graph:

    1. the token count is padded up to one of a few sizes (chunk_graph_sizes), one graph each;
       padding tokens have slot -1 (store nothing) and belong to no sequence;
    2. the step's inputs live in fixed buffers (ChunkBuffers) that the graphs read in place;
    3. attention launches a fixed grid: the host lists the step's query tiles in q_tiles
       (kernels/tile_map.build_tile_map) and the kernel's programs read their
       (sequence, tile) from it, instead of a grid sized by the batch. Rows of one new token
       (decode rows) get no tile: the decode kernel computes them (context.decode_rows),
       padded to min(max_num_sequences, tokens) rows of context 0.

The graph holds the model's body only (embedding to the final norm). The LM head runs
eagerly on each sequence's last row, and attention always reads K/V through
the block tables, also for a chunk with no cached prefix. On a GPU every chunked step that
fits the largest size runs this padded way, graph or not, so enforce_eager=True computes
bit-identical tokens (the same shapes pick the same kernels), as decode steps do.
vLLM gets the same effect from torch.compile's piecewise graphs, with attention left out of
the graph; a fixed attention grid lets one graph cover the whole body here.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from myvllm.engine.batch import StepInputs
from myvllm.kernels.tile_map import (
    SPLIT_KEY_TILES,
    TileMap,
    build_tile_map,
    tile_map_slots,
)
from myvllm.utils.context import Context, DecodeRows, forward_context

# Above this many tokens a step's GPU work (tens of milliseconds) dwarfs launching it, and a
# graph would keep that many tokens' activations allocated for good.
MAX_CHUNK_GRAPH_TOKENS = 2048
# Partial results attention's split tiles may leave per step (build_tile_map): 64 of
# [heads, 128, 128] float32, 64 MiB for 16 heads, allocated per layer from the graph's pool.
NUM_SPLIT_PARTS = 64


def chunk_graph_sizes(max_tokens: int) -> list[int]:
    """Padded token counts of chunked steps: powers of two to 512, then steps of 256 (padding
    costs at most 256 tokens of work where a step is compute-bound), capped at max_tokens."""
    sizes = [n for n in (16, 32, 64, 128, 256, 512) if n < max_tokens]
    sizes += [n for n in range(768, max_tokens, 256)]
    return sizes + [max_tokens]


class ChunkBuffers:
    """The fixed device memory a padded chunked step reads: what its CUDA graph replays on.

    As in the DecodeBuffers, every field lives in one of two device buffers, filled from a
    pinned host copy (two slots that alternate, an event each) with a few copies per step:

        int64:  [ input_ids (T) | positions (T) | row gather (R) | row scatter (R) |
                  pending tokens: position in the batch (R) | row of the token pool (R) ]
        int32:  [ slot_mapping (T) | cu_seqlens_q (S+1) | cu_seqlens_k (S+1) |
                  row context lens (R) | q tiles (tile rows x 5) | combine (parts/2 x 4) |
                  block_tables (S x W) | row block tables (R x W) ]

    T = the largest padded size, S = max_num_sequences, R = min(S, T) decode-row slots,
    W = blocks per sequence. A step copies all of int64 (small), int32 up to its sequences'
    block tables, and its decode rows' block tables.
    """

    def __init__(self, max_tokens: int, max_num_seqs: int, max_width: int, block_m: int,
                 block_n: int, device: torch.device, pin_memory: bool) -> None:
        self.sizes = chunk_graph_sizes(max_tokens)
        self.max_tokens = t = self.sizes[-1]
        self.max_num_seqs = s = max_num_seqs
        self.max_width = w = max_width
        self.block_m = block_m  # the prefill kernel's query tile (rows per program)
        self.block_n = block_n  # and its key tile
        self.split_key_tiles = SPLIT_KEY_TILES  # see build_tile_map (tests lower it)
        r = self.num_rows(t)
        fields64 = [("input_ids", t), ("positions", t), ("row_gather", r), ("row_scatter", r),
                    ("pending_at", r), ("pending_row", r)]
        fields32 = [("slot_mapping", t), ("cu_seqlens_q", s + 1), ("cu_seqlens_k", s + 1),
                    ("row_context_lens", r), ("q_tiles", 5 * self.slots(t)),
                    ("q_tile_combine", 4 * (NUM_SPLIT_PARTS // 2)), ("block_tables", s * w),
                    ("row_block_tables", r * w)]
        self.offset: dict[str, tuple[int, int]] = {}  # field -> (start, end) in its buffer
        for fields in (fields64, fields32):
            start = 0
            for name, size in fields:
                self.offset[name] = (start, start + size)
                start += size
        self.int64 = torch.zeros(self.offset["pending_row"][1], dtype=torch.int64,
                                 device=device)
        self.int32 = torch.zeros(self.offset["row_block_tables"][1], dtype=torch.int32,
                                 device=device)
        self.host64 = [torch.zeros_like(self.int64, device="cpu", pin_memory=pin_memory)
                       for _ in range(2)]
        self.host32 = [torch.zeros_like(self.int32, device="cpu", pin_memory=pin_memory)
                       for _ in range(2)]
        self.copied = [torch.cuda.Event() if pin_memory else None for _ in range(2)]
        self.slot = 0

    def field(self, name: str, buffer: torch.Tensor | None = None) -> torch.Tensor:
        """A field's whole region, of the device buffers (or of the host slot `buffer`)."""
        start, end = self.offset[name]
        if buffer is None:
            buffer = self.int64 if name in _INT64_FIELDS else self.int32
        return buffer[start:end]

    def padded_size(self, num_tokens: int) -> int | None:
        """The smallest size that holds num_tokens, or None when the step is too large."""
        return next((n for n in self.sizes if n >= num_tokens), None)

    def slots(self, padded_tokens: int) -> int:
        return tile_map_slots(padded_tokens, self.max_num_seqs, self.block_m, NUM_SPLIT_PARTS)

    def num_rows(self, padded_tokens: int) -> int:
        """Decode-row slots of a step of this padded size."""
        return min(self.max_num_seqs, padded_tokens)

    def context(self, padded_tokens: int, num_seqs: int, max_seqlen_q: int = 0,
                max_seqlen_k: int = 0) -> Context:
        """The Context of a padded step over these buffers (num_seqs real sequences)."""
        rows = self.num_rows(padded_tokens)
        return Context(
            is_prefill=True,
            cu_seqlens_q=self.field("cu_seqlens_q")[: num_seqs + 1],
            cu_seqlens_k=self.field("cu_seqlens_k")[: num_seqs + 1],
            max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
            slot_mapping=self.field("slot_mapping")[:padded_tokens],
            block_tables=self.field("block_tables").view(self.max_num_seqs, self.max_width),
            q_tiles=TileMap(self.field("q_tiles").view(-1, 5)[: self.slots(padded_tokens)],
                            self.field("q_tile_combine").view(-1, 4), NUM_SPLIT_PARTS),
            decode_rows=DecodeRows(
                gather=self.field("row_gather")[:rows],
                scatter=self.field("row_scatter")[:rows],
                block_tables=self.field("row_block_tables").view(-1, self.max_width)[:rows],
                context_lens=self.field("row_context_lens")[:rows]),
        )

    def fill(self, input_ids: list[int], pending: list[tuple[int, int]], pool: torch.Tensor,
             positions: list[int], slot_mapping: list[int], cu_seqlens_q: list[int],
             cu_seqlens_k: list[int], tables: list[list[int]]) -> StepInputs:
        """Write one step to a host slot, send it (stream-ordered: a step still running on
        the buffers has read them before these copies land), return its padded StepInputs.

        pending: (position in input_ids, row of `pool`) of each token still on the device
        (overlapped scheduling); its entry of input_ids is a placeholder.
        """
        num_tokens, num_seqs = len(positions), len(tables)
        padded = self.padded_size(num_tokens)
        assert padded is not None and num_seqs <= self.max_num_seqs
        seqlens_q = np.diff(cu_seqlens_q).tolist()
        seqlens_k = np.diff(cu_seqlens_k).tolist()
        # Sequences with one new token are decode rows; the others get query tiles.
        one_token = [i for i, n in enumerate(seqlens_q) if n == 1]
        tiles, combine = build_tile_map([0 if n == 1 else n for n in seqlens_q], seqlens_k,
                                        self.block_m, self.block_n, self.slots(padded),
                                        NUM_SPLIT_PARTS, self.split_key_tiles)
        rows, num_rows = self.num_rows(padded), len(one_token)
        row_tokens = [cu_seqlens_q[i] for i in one_token]

        slot, self.slot = self.slot, 1 - self.slot
        event = self.copied[slot]
        if event is not None:
            event.synchronize()  # the copy two steps ago out of this slot (long done)
        h64, h32 = self.host64[slot].numpy(), self.host32[slot].numpy()

        def put(name: str, values: list[int] | np.ndarray) -> None:
            start, _ = self.offset[name]
            host = h64 if name in _INT64_FIELDS else h32
            host[start: start + len(values)] = values

        # Padding tokens store nothing (slot -1); their ids and positions are left over from
        # an earlier step, valid values whose results nobody reads.
        put("input_ids", input_ids)
        put("positions", positions)
        put("slot_mapping", slot_mapping + [-1] * (padded - num_tokens))
        put("cu_seqlens_q", cu_seqlens_q)
        put("cu_seqlens_k", cu_seqlens_k)
        put("q_tiles", tiles)
        put("q_tile_combine", combine)
        # Decode rows; padding rows attend to nothing and write to the spare row `padded`.
        put("row_gather", row_tokens + [0] * (rows - num_rows))
        put("row_scatter", row_tokens + [padded] * (rows - num_rows))
        put("row_context_lens", [seqlens_k[i] for i in one_token] + [0] * (rows - num_rows))
        put("pending_at", [at for at, _ in pending])
        put("pending_row", [row for _, row in pending])
        block_tables = self.field("block_tables", self.host32[slot]).numpy()
        block_tables = block_tables.reshape(-1, self.max_width)
        row_tables = self.field("row_block_tables", self.host32[slot]).numpy()
        row_tables = row_tables.reshape(-1, self.max_width)
        block_tables[:num_seqs].fill(-1)
        for row, table in enumerate(tables):
            block_tables[row, : len(table)] = table
        row_tables[:num_rows] = block_tables[one_token]

        non_blocking = event is not None
        self.int64.copy_(self.host64[slot], non_blocking=non_blocking)
        end = self.offset["block_tables"][0] + num_seqs * self.max_width
        self.int32[:end].copy_(self.host32[slot][:end], non_blocking=non_blocking)
        if num_rows:
            start = self.offset["row_block_tables"][0]
            end = start + num_rows * self.max_width
            self.int32[start:end].copy_(self.host32[slot][start:end], non_blocking=non_blocking)
        if event is not None:
            event.record()
        ids = self.field("input_ids")
        if pending:  # tokens sampled by the step before, still on the device
            at = self.field("pending_at")[: len(pending)]
            ids.index_copy_(0, at, pool.index_select(0, self.field("pending_row")[: len(pending)]))
        context = self.context(padded, num_seqs, max(seqlens_q), max(seqlens_k))
        return StepInputs(ids[:padded], self.field("positions")[:padded], context)


_INT64_FIELDS = frozenset({"input_ids", "positions", "row_gather", "row_scatter", "pending_at",
                           "pending_row"})


# What a chunk graph captures: the model's body on padded StepInputs -> hidden states.
BodyForward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class ChunkGraphRunner:
    def __init__(self) -> None:
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.graph_hidden: dict[int, torch.Tensor] = {}

    def __contains__(self, padded_tokens: int) -> bool:
        return padded_tokens in self.graphs

    @torch.inference_mode()
    def capture(self, body: BodyForward, buffers: ChunkBuffers) -> None:
        """One graph per padded size, largest first, sharing one memory pool. Captured with
        no tiles (sequence -1 everywhere) and slot -1: the capture computes nothing real."""
        buffers.field("q_tiles").fill_(-1)
        buffers.field("q_tile_combine").fill_(-1)
        buffers.field("slot_mapping").fill_(-1)
        buffers.field("row_gather").zero_()
        buffers.field("row_context_lens").zero_()
        pool = None
        for size in sorted(buffers.sizes, reverse=True):
            buffers.field("row_scatter").fill_(size)  # the spare output row of this size
            # All max_num_seqs sequences: the launch must not see an empty batch.
            context = buffers.context(size, buffers.max_num_seqs)
            ids, positions = buffers.field("input_ids")[:size], buffers.field("positions")[:size]
            graph = torch.cuda.CUDAGraph()
            with forward_context(context):
                body(ids, positions)  # warm-up outside the graph (Triton compiles, cuBLAS)
                with torch.cuda.graph(graph, pool):
                    self.graph_hidden[size] = body(ids, positions)
            if pool is None:
                pool = graph.pool()
            self.graphs[size] = graph
            torch.cuda.synchronize()
        # A graph's first launch uploads it to the device: 1.1 ms of host time in the first
        # step that replayed a 768-token graph on the H200, mid-serving. Done here instead,
        # on the capture's inputs (no tiles, slot -1: nothing computed, nothing stored).
        for graph in self.graphs.values():
            graph.replay()
        torch.cuda.synchronize()

    def replay(self, padded_tokens: int) -> torch.Tensor:
        """Run the graph of this size on what ChunkBuffers.fill wrote; the hidden states of
        all its rows (padding rows hold garbage)."""
        self.graphs[padded_tokens].replay()
        return self.graph_hidden[padded_tokens]

    def release(self, device: torch.device) -> None:
        """Drop the graphs (see GraphRunner.release: before the process group goes)."""
        if self.graphs:
            torch.cuda.synchronize(device)
            self.graphs.clear()
            self.graph_hidden.clear()
