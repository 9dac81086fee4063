"""Padded steps on fixed buffers: what lets a GPU replay a step from a CUDA graph.

A CUDA graph replays fixed shapes on fixed memory. So on a GPU every step that fits a graph
is padded to one of a few sizes and staged into StaticBuffers (worker/static_buffers.py),
graph or not: enforce_eager=True then sees the same shapes, picks the same kernels and
computes bit-identical tokens.

    decode    the batch is padded to a graph batch size (cuda_graph_batch_sizes) and the
              block tables to max_model_length; padding rows have slot -1 (store nothing:
              stale values would overwrite a live sequence's K/V) and context length 0.
    prefill   a step of prompt chunks (and the decode rows beside them) of up to
              MAX_CHUNK_GRAPH_TOKENS tokens is padded to a chunk graph size
              (chunk_graph_sizes), its sequences to max_num_sequences. Attention then
              launches a fixed grid: the host lists the step's query tiles in a TileMap
              (kernels/tile_map.py) and each program reads its (sequence, tile) from it.
              Rows of one new token get no tile: the decode kernel computes them
              (Context.decode_rows). Padding tokens have slot -1 and belong to no sequence.

A chunked step eagerly costs Python's price for launching some 300 kernels whatever the GPU
has to do: tens of milliseconds, where a step of a few hundred tokens keeps the GPU busy for
a few, and every decoding stream waits for it. vLLM gets the same effect from torch.compile's
piecewise graphs, with attention left out of the graph; the fixed attention grid lets one
graph cover the whole model body here.

All fields live in one StaticBuffers, the sampled-token pool first and the ids known on the
host right after it, so that one index_select gathers every step's input ids
(worker/pending_tokens.py).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from myvllm.config import Config
from myvllm.engine.batch import StepInputs
from myvllm.worker.pending_tokens import gather, token_index
from myvllm.worker.static_buffers import StaticBuffers
from myvllm.worker.token_pool import TokenPool
from myvllm.kernels import is_batch_invariant
from myvllm.kernels.tile_map import (SPLIT_KEY_TILES, DecodeRows, TileMap, build_tile_map,
                                     tile_map_slots)
from myvllm.utils.context import Context

# Above this many tokens a step's GPU work (tens of milliseconds) dwarfs launching it, and a
# graph would keep that many tokens' activations allocated for good.
MAX_CHUNK_GRAPH_TOKENS = 2048
# Partial results attention's split tiles may leave per step (build_tile_map): 64 of
# [heads, 128, 128] float32, 64 MiB for 16 heads, allocated per layer from the graph's pool.
NUM_SPLIT_PARTS = 64


class PaddableInputs(Protocol):
    """An InputBuilder (worker/input_builder.py), as pad_steps sees it."""

    config: Config
    max_blocks_per_seq: int
    device: torch.device
    padded: PaddedSteps | None
    pool: TokenPool


def pad_steps(inputs: PaddableInputs, chunk_tiles: tuple[int, int] | None,
              max_chunk_tokens: int = MAX_CHUNK_GRAPH_TOKENS) -> PaddedSteps:
    """From now on the builder pads decode steps, and (with chunk_tiles, the prefill kernel's
    query and key tile) chunked steps of up to max_chunk_tokens, to graph sizes on fixed
    buffers."""
    config = inputs.config
    inputs.padded = PaddedSteps(config.max_num_sequences, inputs.max_blocks_per_seq,
                                min(max_chunk_tokens, config.max_num_batched_tokens),
                                chunk_tiles, inputs.device)
    inputs.pool = inputs.padded.pool
    return inputs.padded


def cuda_graph_batch_sizes(max_num_sequences: int) -> list[int]:
    """The decode batch sizes that get a CUDA graph: [1, 2, 4, 8] + range(16, max+1, 16),
    capped at max_num_sequences, and max_num_sequences itself."""
    sizes = [bs for bs in (1, 2, 4, 8) if bs <= max_num_sequences]
    sizes += list(range(16, max_num_sequences + 1, 16))
    if max_num_sequences not in sizes:
        sizes.append(max_num_sequences)  # so every batch up to the maximum has a graph
    return sizes


def chunk_graph_sizes(max_tokens: int) -> list[int]:
    """Padded token counts of chunked steps: powers of two to 512, then steps of 256 (padding
    costs at most 256 tokens of work where a step is compute-bound), capped at max_tokens."""
    sizes = [n for n in (16, 32, 64, 128, 256, 512) if n < max_tokens]
    sizes += [n for n in range(768, max_tokens, 256)]
    return sizes + [max_tokens]


class PaddedSteps:
    """Pads and stages decode steps and (with chunk_tiles) chunked steps onto fixed buffers.

    chunk_tiles: the prefill kernel's (query, key) tile, for the TileMap of padded chunked
    steps; None pads decode steps only (prefill-first, or a CPU test of decode padding).
    """

    def __init__(self, max_num_seqs: int, max_width: int, max_chunk_tokens: int,
                 chunk_tiles: tuple[int, int] | None, device: torch.device) -> None:
        self.max_num_seqs = s = max_num_seqs
        self.max_width = w = max_width
        self.decode_sizes = cuda_graph_batch_sizes(max_num_seqs)
        self.chunk_sizes = chunk_graph_sizes(max_chunk_tokens) if chunk_tiles else []
        self.block_m, self.block_n = chunk_tiles or (0, 0)
        # See build_tile_map (tests lower it); batch-invariant mode splits no tile.
        self.split_key_tiles: int | None = None if is_batch_invariant() else SPLIT_KEY_TILES
        t = max([s, *self.chunk_sizes])  # most input tokens of a padded step
        r = self.num_rows(t)
        slots = self.slots(t) if chunk_tiles is not None else 0
        i64, i32, f32 = torch.int64, torch.int32, torch.float32
        self.buffers = StaticBuffers({
            "sampled": (i64, s), "host_ids": (i64, t),  # [pool | host ids]: one gather
            "positions": (i64, t), "token_index": (i64, t),
            "row_gather": (i64, r), "row_scatter": (i64, r),
            "slot_mapping": (i32, t), "context_lens": (i32, s), "temperatures": (f32, s),
            "block_tables": (i32, s * w),
            "cu_seqlens_q": (i32, s + 1), "cu_seqlens_k": (i32, s + 1),
            "row_context_lens": (i32, r), "q_tiles": (i32, 5 * slots),
            "q_tile_combine": (i32, 4 * (NUM_SPLIT_PARTS // 2)), "row_block_tables": (i32, r * w),
        }, device)
        # Gathered from [pool | host ids], so not a view of that buffer.
        self.input_ids = torch.zeros(t, dtype=torch.int64, device=device)
        self.pool = TokenPool(self.buffers.field("sampled"))

    # ------------------------------------------------------------------ sizes
    def decode_batch_size(self, num_seqs: int) -> int:
        return next(bs for bs in self.decode_sizes if bs >= num_seqs)

    def chunk_size(self, num_tokens: int) -> int | None:
        """The smallest chunk graph size that holds num_tokens, or None (too large)."""
        return next((n for n in self.chunk_sizes if n >= num_tokens), None)

    def slots(self, padded_tokens: int) -> int:
        return tile_map_slots(padded_tokens, self.max_num_seqs, self.block_m, NUM_SPLIT_PARTS)

    def num_rows(self, padded_tokens: int) -> int:
        """Decode-row slots of a chunked step of this padded size."""
        return min(self.max_num_seqs, padded_tokens)

    # ------------------------------------------------------------------ decode
    def decode(self, host_ids: list[int], pending: list[tuple[int, int]], positions: list[int],
               slot_mapping: list[int], context_lens: list[int], temperatures: list[float],
               tables: list[list[int]]) -> StepInputs:
        """Stage one decode step, padded to a graph batch size."""
        num_seqs = len(host_ids)
        bs = self.decode_batch_size(num_seqs)
        pad = bs - num_seqs
        self.buffers.stage({
            "host_ids": np.array(host_ids + [0] * pad, dtype=np.int64),
            "positions": np.array(positions + [0] * pad, dtype=np.int64),
            "token_index": token_index(self.pool.size, bs, pending),
            "slot_mapping": np.array(slot_mapping + [-1] * pad, dtype=np.int32),
            "context_lens": np.array(context_lens + [0] * pad, dtype=np.int32),
            "temperatures": np.array(temperatures + [0.0] * pad, dtype=np.float32),
        }, tables={"block_tables": (tables, bs, self.max_width)})
        self.gather_input_ids(bs)
        return self.decode_inputs(bs)

    def decode_inputs(self, bs: int) -> StepInputs:
        """The StepInputs of a decode step of bs rows on these buffers (what its graph
        reads)."""
        field = self.buffers.field
        context = Context(is_prefill=False, slot_mapping=field("slot_mapping", bs),
                          context_lens=field("context_lens", bs),
                          block_tables=field("block_tables", bs * self.max_width).view(
                              bs, self.max_width))
        return StepInputs(self.input_ids[:bs], field("positions", bs), context,
                          temperatures=field("temperatures", bs), sampled=field("sampled", bs))

    def gather_input_ids(self, n: int) -> None:
        """input_ids[:n] from [pool | host ids], by the staged token_index."""
        gather(self.buffers.span("sampled", "host_ids"), self.buffers.field("token_index", n),
               out=self.input_ids[:n])

    # ------------------------------------------------------------------ chunked prefill
    def prefill(self, host_ids: list[int], pending: list[tuple[int, int]],
                positions: list[int], slot_mapping: list[int], cu_seqlens_q: list[int],
                cu_seqlens_k: list[int], tables: list[list[int]]) -> StepInputs:
        """Stage one chunked step, padded to a chunk graph size (chunk_size must fit it)."""
        num_tokens, num_seqs = len(positions), len(tables)
        padded = self.chunk_size(num_tokens)
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
        pad = padded - num_tokens
        i32, i64 = np.int32, np.int64
        # Padding tokens store nothing (slot -1); their ids and positions are 0, valid values
        # whose results nobody reads. Padding decode rows attend to nothing and write to the
        # spare row `padded`.
        self.buffers.stage({
            "host_ids": np.array(host_ids + [0] * pad, dtype=i64),
            "positions": np.array(positions + [0] * pad, dtype=i64),
            "token_index": token_index(self.pool.size, padded, pending),
            "row_gather": np.array(row_tokens + [0] * (rows - num_rows), dtype=i64),
            "row_scatter": np.array(row_tokens + [padded] * (rows - num_rows), dtype=i64),
            "slot_mapping": np.array(slot_mapping + [-1] * pad, dtype=i32),
            "cu_seqlens_q": np.array(cu_seqlens_q, dtype=i32),
            "cu_seqlens_k": np.array(cu_seqlens_k, dtype=i32),
            "row_context_lens": np.array([seqlens_k[i] for i in one_token]
                                         + [0] * (rows - num_rows), dtype=i32),
            "q_tiles": np.array(tiles, dtype=i32),
            "q_tile_combine": np.array(combine, dtype=i32),
        }, tables={"block_tables": (tables, num_seqs, self.max_width),
                   "row_block_tables": ([tables[i] for i in one_token], num_rows,
                                        self.max_width)})
        self.gather_input_ids(padded)
        return self.prefill_inputs(padded, num_seqs, max(seqlens_q), max(seqlens_k))

    def prefill_inputs(self, padded: int, num_seqs: int, max_seqlen_q: int = 0,
                       max_seqlen_k: int = 0) -> StepInputs:
        """The StepInputs of a padded chunked step on these buffers (num_seqs real
        sequences; what its graph reads)."""
        field = self.buffers.field
        rows, w = self.num_rows(padded), self.max_width
        context = Context(
            is_prefill=True,
            cu_seqlens_q=field("cu_seqlens_q", num_seqs + 1),
            cu_seqlens_k=field("cu_seqlens_k", num_seqs + 1),
            max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
            slot_mapping=field("slot_mapping", padded),
            block_tables=field("block_tables").view(self.max_num_seqs, w),
            q_tiles=TileMap(field("q_tiles").view(-1, 5)[: self.slots(padded)],
                            field("q_tile_combine").view(-1, 4), NUM_SPLIT_PARTS),
            decode_rows=DecodeRows(
                gather=field("row_gather", rows), scatter=field("row_scatter", rows),
                block_tables=field("row_block_tables", rows * w).view(rows, w),
                context_lens=field("row_context_lens", rows)),
        )
        return StepInputs(self.input_ids[:padded], field("positions", padded), context)

    # ------------------------------------------------------------------ graph capture
    def capture_decode_inputs(self, bs: int) -> StepInputs:
        """A decode step of bs padding rows (slot -1, context 0): what its graph is captured
        on; the capture computes nothing real."""
        for name in ("slot_mapping", "block_tables"):
            self.buffers.field(name).fill_(-1)
        for name in ("context_lens", "temperatures", "positions"):
            self.buffers.field(name).zero_()
        self.input_ids.zero_()
        return self.decode_inputs(bs)

    def capture_prefill_inputs(self, padded: int) -> StepInputs:
        """A chunked step with no tiles (sequence -1 everywhere) and slot -1, over all
        max_num_seqs sequences (the launch must not see an empty batch)."""
        for name in ("q_tiles", "q_tile_combine", "slot_mapping"):
            self.buffers.field(name).fill_(-1)
        for name in ("row_gather", "row_context_lens", "positions"):
            self.buffers.field(name).zero_()
        self.input_ids.zero_()
        self.buffers.field("row_scatter").fill_(padded)  # the spare output row of this size
        return self.prefill_inputs(padded, self.max_num_seqs)
