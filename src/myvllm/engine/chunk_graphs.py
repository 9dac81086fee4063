"""Step 5c: CUDA graphs of chunked-prefill steps (prompt chunks and decode rows together).

A chunked-prefill step has a new shape at every step (how many decode rows, which chunks),
so run eagerly it pays Python's price for launching some 300 kernels (28 layers of the
Qwen3-0.6B shape) whatever the GPU has to do: tens of milliseconds, where a step of a few
hundred tokens keeps the GPU busy for a few. Every decoding stream waits for that step.
Three things make such a step replayable from a CUDA graph:

    1. the token count is padded up to one of a few sizes (chunk_graph_sizes), one graph each;
       padding tokens have slot -1 (store nothing) and belong to no sequence;
    2. the step's inputs live in fixed buffers (ChunkBuffers) that the graphs read in place;
    3. attention launches a fixed grid: the host lists the step's query tiles in q_tiles
       (kernels/prefill_attention.build_tile_map) and the kernel's programs read their
       (sequence, tile) from it, instead of a grid sized by the batch. Rows of one new token
       (decode rows) get no tile: the decode kernel computes them (context.decode_rows),
       padded to min(max_num_sequences, tokens) rows of context 0.

The graph holds the model's body only (embedding to the final norm). The LM head runs
eagerly on the one row per sequence that samples, and attention always reads K/V through
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
from myvllm.kernels.prefill_attention import (
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
    """The fixed device memory a padded chunked step reads: what its CUDA graph replays on."""

    def __init__(self, max_tokens: int, max_num_seqs: int, max_width: int, block_m: int,
                 block_n: int, device: torch.device, pin_memory: bool) -> None:
        self.sizes = chunk_graph_sizes(max_tokens)
        self.max_tokens = self.sizes[-1]
        self.max_num_seqs = max_num_seqs
        self.block_m = block_m  # the prefill kernel's query tile (rows per program)
        self.block_n = block_n  # and its key tile
        self.split_key_tiles = SPLIT_KEY_TILES  # see build_tile_map (tests lower it)
        self.device = device
        self.pin_memory = pin_memory
        self.input_ids = torch.zeros(self.max_tokens, dtype=torch.int64, device=device)
        self.positions = torch.zeros(self.max_tokens, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((self.max_tokens,), -1, dtype=torch.int32, device=device)
        self.cu_seqlens_q = torch.zeros(max_num_seqs + 1, dtype=torch.int32, device=device)
        self.cu_seqlens_k = torch.zeros(max_num_seqs + 1, dtype=torch.int32, device=device)
        self.block_tables = torch.full((max_num_seqs, max_width), -1, dtype=torch.int32,
                                       device=device)
        self.q_tiles = torch.full((self.slots(self.max_tokens), 5), -1, dtype=torch.int32,
                                  device=device)
        self.q_tile_combine = torch.full((NUM_SPLIT_PARTS // 2, 4), -1, dtype=torch.int32,
                                         device=device)
        rows = min(max_num_seqs, self.max_tokens)
        self.row_gather = torch.zeros(rows, dtype=torch.int64, device=device)
        self.row_scatter = torch.zeros(rows, dtype=torch.int64, device=device)
        self.row_block_tables = torch.full((rows, max_width), -1, dtype=torch.int32,
                                           device=device)
        self.row_context_lens = torch.zeros(rows, dtype=torch.int32, device=device)

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
        return Context(
            is_prefill=True,
            cu_seqlens_q=self.cu_seqlens_q[: num_seqs + 1],
            cu_seqlens_k=self.cu_seqlens_k[: num_seqs + 1],
            max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
            slot_mapping=self.slot_mapping[:padded_tokens],
            block_tables=self.block_tables,
            q_tiles=TileMap(self.q_tiles[: self.slots(padded_tokens)], self.q_tile_combine,
                            NUM_SPLIT_PARTS),
            decode_rows=DecodeRows(
                gather=self.row_gather[: self.num_rows(padded_tokens)],
                scatter=self.row_scatter[: self.num_rows(padded_tokens)],
                block_tables=self.row_block_tables[: self.num_rows(padded_tokens)],
                context_lens=self.row_context_lens[: self.num_rows(padded_tokens)]),
        )

    def _host(self, array: np.ndarray) -> torch.Tensor:
        """A host tensor to copy from; pinned on a GPU (a copy from pageable memory would
        wait for the running step)."""
        tensor = torch.from_numpy(array)
        return tensor.pin_memory() if self.pin_memory else tensor

    def fill(self, ids: torch.Tensor, positions: list[int], slot_mapping: list[int],
             cu_seqlens_q: list[int], cu_seqlens_k: list[int], tables: list[list[int]],
             to_device: Callable[[list[int], torch.dtype], torch.Tensor]) -> StepInputs:
        """Copy one step into the buffers (stream-ordered: a step still running on them has
        read them before these copies land) and return its padded StepInputs."""
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
        self.input_ids[:num_tokens].copy_(ids, non_blocking=True)
        self.positions[:num_tokens].copy_(to_device(positions, torch.int64), non_blocking=True)
        # Padding tokens store nothing (slot -1); their ids and positions are left over from
        # an earlier step, valid values whose results nobody reads.
        slots = slot_mapping + [-1] * (padded - num_tokens)
        self.slot_mapping[:padded].copy_(to_device(slots, torch.int32), non_blocking=True)
        self.cu_seqlens_q[: num_seqs + 1].copy_(to_device(cu_seqlens_q, torch.int32),
                                                non_blocking=True)
        self.cu_seqlens_k[: num_seqs + 1].copy_(to_device(cu_seqlens_k, torch.int32),
                                                non_blocking=True)
        width = max(len(table) for table in tables)
        table_array = np.full((num_seqs, width), -1, dtype=np.int32)
        for row, table in enumerate(tables):
            table_array[row, : len(table)] = table
        self.block_tables[:num_seqs, :width].copy_(self._host(table_array), non_blocking=True)
        self.q_tiles[: self.slots(padded)].copy_(
            to_device(tiles, torch.int32).view(-1, 5), non_blocking=True)
        self.q_tile_combine.copy_(to_device(combine, torch.int32).view(-1, 4),
                                  non_blocking=True)
        num_rows = len(one_token)
        pad_rows = self.num_rows(padded) - num_rows
        tokens = [cu_seqlens_q[i] for i in one_token]
        self.row_gather[: num_rows + pad_rows].copy_(
            to_device(tokens + [0] * pad_rows, torch.int64), non_blocking=True)
        self.row_scatter[: num_rows + pad_rows].copy_(
            to_device(tokens + [padded] * pad_rows, torch.int64), non_blocking=True)
        self.row_context_lens[: num_rows + pad_rows].copy_(
            to_device([seqlens_k[i] for i in one_token] + [0] * pad_rows, torch.int32),
            non_blocking=True)
        if one_token:
            self.row_block_tables[:num_rows, :width].copy_(
                self._host(table_array[one_token]), non_blocking=True)
        context = self.context(padded, num_seqs, max(seqlens_q), max(seqlens_k))
        return StepInputs(self.input_ids[:padded], self.positions[:padded], context)


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
        buffers.q_tiles.fill_(-1)
        buffers.q_tile_combine.fill_(-1)
        buffers.slot_mapping.fill_(-1)
        buffers.row_gather.zero_()
        buffers.row_context_lens.zero_()
        pool = None
        for size in sorted(buffers.sizes, reverse=True):
            buffers.row_scatter.fill_(size)  # the spare output row of this size
            # All max_num_seqs sequences: the launch must not see an empty batch.
            context = buffers.context(size, buffers.max_num_seqs)
            ids, positions = buffers.input_ids[:size], buffers.positions[:size]
            graph = torch.cuda.CUDAGraph()
            with forward_context(context):
                body(ids, positions)  # warm-up outside the graph (Triton compiles, cuBLAS)
                with torch.cuda.graph(graph, pool):
                    self.graph_hidden[size] = body(ids, positions)
            if pool is None:
                pool = graph.pool()
            self.graphs[size] = graph
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
