"""Step 4a: the InputBuilder turns a scheduled batch into the tensors of one forward pass.

Host lists (token ids, positions, slots) become device tensors without making the host wait:
a prefill's through pinned host tensors and non_blocking copies, a decode step's through the
fixed DecodeBuffers (engine/decode_buffers.py), which a captured CUDA graph reads in place.

A token's slot in the paged KV cache is block_id * block_size + offset:

    block_table of a sequence = [7, 2, 9], block_size 4, 10 tokens
    token:   0  1  2  3 | 4  5  6  7 | 8  9
    slot:   28 29 30 31 | 8  9 10 11 |36 37
"""

from __future__ import annotations

import numpy as np
import torch

from myvllm.config import Config
from myvllm.engine.batch import StepInputs
from myvllm.engine.chunk_graphs import ChunkBuffers
from myvllm.engine.decode_buffers import DecodeBuffers, DecodeViews
from myvllm.engine.sequence import Sequence
from myvllm.utils.context import Context
from myvllm.utils.device import resolve_device

NUMPY_DTYPES = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32}


def cuda_graph_batch_sizes(max_num_sequences: int) -> list[int]:
    """The decode batch sizes that get a CUDA graph: [1, 2, 4, 8] + range(16, max+1, 16),
    capped at max_num_sequences, and max_num_sequences itself."""
    sizes = [bs for bs in (1, 2, 4, 8) if bs <= max_num_sequences]
    sizes += list(range(16, max_num_sequences + 1, 16))
    if max_num_sequences not in sizes:
        sizes.append(max_num_sequences)  # so every batch up to the maximum has a graph
    return sizes


class InputBuilder:
    """Builds StepInputs for prefill and decode steps; owns the DecodeBuffers.

    Needs no model: the examples use it alone to show what a step's tensors look like.
    """

    def __init__(self, config: Config, device: torch.device | None = None, rank: int = 0) -> None:
        self.config = config
        self.rank = rank
        self.block_size = config.block_size
        self.device = device if device is not None else resolve_device(config)
        self.pin_memory = self.device.type == "cuda"
        # Pad decode batches to graph shapes on a GPU (see decode_batch_size); a CPU has no
        # graphs and gains nothing from padding (tests switch it on to exercise the padding).
        self.pad_decode = self.device.type == "cuda"
        self.decode_sizes = cuda_graph_batch_sizes(config.max_num_sequences)
        if config.max_model_length is None:
            raise ValueError("InputBuilder needs config.max_model_length (the engine resolves "
                             "None from the checkpoint)")
        self.max_blocks_per_seq = -(-config.max_model_length // self.block_size)
        # A decode step's inputs and sampled tokens live in fixed buffers: no allocation per
        # step, and a CUDA graph reads them in place.
        self.decode_buffers = DecodeBuffers(config.max_num_sequences, self.max_blocks_per_seq,
                                            self.device, self.pin_memory)
        # Chunked steps up to this many tokens are padded into fixed buffers (engine/
        # chunk_graphs.py); the ModelRunner switches it on (on a GPU), tests on a CPU.
        self.chunk_buffers: ChunkBuffers | None = None

    def pad_chunked_steps(self, max_tokens: int, block_m: int, block_n: int) -> ChunkBuffers:
        """From now on, run chunked steps of at most max_tokens tokens padded, on fixed
        buffers, with attention's tiles (block_m query rows, block_n keys) listed in
        q_tiles."""
        self.chunk_buffers = ChunkBuffers(
            min(max_tokens, self.config.max_num_batched_tokens), self.config.max_num_sequences,
            self.max_blocks_per_seq, block_m, block_n, self.device, self.pin_memory)
        return self.chunk_buffers

    def to_device(self, values: list[int] | list[float], dtype: torch.dtype) -> torch.Tensor:
        """Host list -> (pinned) CPU tensor -> device, without making the host wait. Through
        numpy: torch.tensor() of a long Python list is ~3x slower (a 32k-token chunk's ids,
        positions and slots took ~7 ms on the development machine)."""
        tensor = torch.from_numpy(np.array(values, dtype=NUMPY_DTYPES[dtype]))
        if self.pin_memory:
            tensor = tensor.pin_memory()
        return tensor.to(self.device, non_blocking=True)

    def prepare_block_tables(self, seqs: list[Sequence]) -> torch.Tensor:
        """Block tables padded with -1 to a rectangle (the kernels never read past the context).

        For a prefill with a cached prefix; decode steps fill theirs in DecodeBuffers. The
        width is a multiple of 16: Triton compiles a kernel variant per "divisible by 16 or
        not" of each int argument, the rows' stride among them, and a variant met first in
        the middle of a run took ~2 s there (warmup_cached_prefix_prefill compiles this one).
        """
        width = -(-max(len(seq.block_table) for seq in seqs) // 16) * 16
        tables = np.full((len(seqs), width), -1, dtype=np.int32)
        for row, seq in enumerate(seqs):
            tables[row, : len(seq.block_table)] = seq.block_table
        return torch.from_numpy(tables).to(self.device)

    def prepare_prefill(self, seqs: list[Sequence]) -> StepInputs:
        """A prefill step: each sequence computes its next num_new_tokens tokens, the ones
        just below num_computed_tokens (the scheduler advanced it past them). A whole prompt
        after its cached prefix is one such chunk; with chunked prefill, a part of one.

        Prompt chunks and decode rows (chunks of one token) go through the same varlen
        attention, reading everything before the chunk from the paged cache:

            A: 12-token prompt, chunk 2 of 8 tokens   B: decoding, 6 tokens so far
            input_ids    = [a4 .. a11 | b5]
            positions    = [ 4 .. 11  |  5]
            cu_seqlens_q = [0, 8, 9]       new tokens per sequence
            cu_seqlens_k = [0, 12, 15]     context per sequence: everything up to the chunk's end

        A decode row whose token is still pending (overlapped scheduling) takes it from the
        sampled-token pool on the device, as a decode step does.

        With pad_chunked_steps on, a step that fits goes to the fixed ChunkBuffers instead,
        padded to a graph size (engine/chunk_graphs.py); there the decode rows are left to
        the decode kernel and the chunks' query tiles are listed in a TileMap.
        """
        input_ids: list[int] = []
        positions: list[int] = []
        cu_seqlens_q, cu_seqlens_k = [0], [0]
        slot_mapping: list[int] = []
        pool_size = self.decode_buffers.max_bs
        pending_rows: list[tuple[int, int]] = []  # (index in input_ids, row of the pool)
        for seq in seqs:
            end = seq.num_computed_tokens
            start = end - seq.num_new_tokens
            if seq.num_new_tokens == 1 and end == len(seq):  # the sequence's last token
                if seq.num_pending_tokens:
                    assert seq.sampled_row is not None, "a pending token but no step"
                    pending_rows.append((len(input_ids), seq.sampled_row))
                    input_ids.append(0)
                else:
                    input_ids.append(seq.last_token)
            else:
                input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            cu_seqlens_q.append(cu_seqlens_q[-1] + end - start)
            cu_seqlens_k.append(cu_seqlens_k[-1] + end)
            if not seq.block_table:  # the warm-up's made-up sequences: no cache to write to
                continue
            # Slots block by block (one range per block, not one Python step per token: a
            # chunk can be 16k tokens long).
            pos = start
            while pos < end:
                offset = pos % self.block_size
                count = min(self.block_size - offset, end - pos)
                first = seq.block_table[pos // self.block_size] * self.block_size + offset
                slot_mapping.extend(range(first, first + count))
                pos += count
        buffers = self.chunk_buffers
        if buffers is not None and buffers.padded_size(len(positions)) is not None:
            return buffers.fill(input_ids, pending_rows, self.decode_buffers.sampled, positions,
                                slot_mapping, cu_seqlens_q, cu_seqlens_k,
                                [seq.block_table for seq in seqs])
        ids = self.to_device(input_ids, torch.int64)
        if pending_rows:
            # [pool | host ids] indexed once: pending rows read the pool, the others their id.
            index = list(range(pool_size, pool_size + len(input_ids)))
            for position, row in pending_rows:
                index[position] = row
            ids = torch.cat([self.decode_buffers.sampled, ids]).index_select(
                0, self.to_device(index, torch.int64))
        context = Context(
            is_prefill=True,
            cu_seqlens_q=self.to_device(cu_seqlens_q, torch.int32),
            cu_seqlens_k=self.to_device(cu_seqlens_k, torch.int32),
            max_seqlen_q=max(seq.num_new_tokens for seq in seqs),
            max_seqlen_k=max(seq.num_computed_tokens for seq in seqs),
            slot_mapping=self.to_device(slot_mapping, torch.int32),
            block_tables=(self.prepare_block_tables(seqs)
                          if cu_seqlens_k[-1] > cu_seqlens_q[-1] else None),
        )
        return StepInputs(ids, self.to_device(positions, torch.int64), context)

    def decode_batch_size(self, num_seqs: int) -> int:
        """The padded batch size a decode step runs at.

        On a GPU, decode always runs at one of the CUDA-graph sizes and with block tables as
        wide as max_model_length, graphs or not. The kernels then see the same shapes in
        both modes, pick the same tiles and split-K chunks, and cuBLAS the same algorithms,
        so enforce_eager=True and CUDA graphs give bit-identical tokens. Padding rows
        use slot -1 (store nothing) and context length 0 (attend to nothing).
        """
        if not self.pad_decode:
            return num_seqs
        return next((bs for bs in self.decode_sizes if bs >= num_seqs), num_seqs)

    def prepare_decode(self, seqs: list[Sequence]) -> StepInputs:
        """One new token per sequence; its K/V goes to the slot after the last one used.

        The values go to the fixed DecodeBuffers (two host-to-device copies, no allocation).
        A sequence whose last token is still pending (overlapped scheduling) reads it from
        the sampled-token pool on the device, without a round trip to the host.
        """
        bs = self.decode_batch_size(len(seqs))
        padding = bs - len(seqs)
        pool_size = self.decode_buffers.max_bs
        token_index = []  # see DecodeBuffers: where each row's input id is read from
        for row, seq in enumerate(seqs):
            if seq.num_pending_tokens == 0:
                token_index.append(pool_size + row)  # the host id below
            else:
                assert seq.sampled_row is not None, "a pending token but no step"
                token_index.append(seq.sampled_row)
        token_index += [pool_size + row for row in range(len(seqs), bs)]
        input_ids = [seq.last_token if seq.num_pending_tokens == 0 else 0 for seq in seqs]
        input_ids += [0] * padding
        positions = [len(seq) - 1 for seq in seqs] + [0] * padding
        context_lens = [len(seq) for seq in seqs] + [0] * padding
        slot_mapping = [seq.block_table[-1] * self.block_size + seq.last_block_num_tokens - 1
                        for seq in seqs] + [-1] * padding
        # Only rank 0 samples (a worker's copy of a Sequence carries no sampling_params).
        temperatures = [seq.sampling_params.temperature if self.rank == 0 else 0.0
                        for seq in seqs] + [0.0] * padding
        width = (self.max_blocks_per_seq if self.pad_decode
                 else max(len(seq.block_table) for seq in seqs))
        views = self.decode_buffers.copy_in(
            bs, width, [input_ids, positions, token_index], [slot_mapping, context_lens],
            temperatures, [seq.block_table for seq in seqs])
        return decode_step_inputs(views)


def decode_step_inputs(views: DecodeViews) -> StepInputs:
    """The StepInputs of a decode step whose values are in these DecodeBuffers views."""
    context = Context(is_prefill=False, slot_mapping=views.slot_mapping,
                      context_lens=views.context_lens, block_tables=views.block_tables)
    return StepInputs(views.input_ids, views.positions, context, views)

