"""Step 4: the InputBuilder turns a scheduled batch into the tensors of one forward pass.

It computes each step's inputs on the host and stages them on the device (worker/staging.py;
on a GPU a step that fits a CUDA graph is padded onto fixed buffers instead,
worker/padded_steps.py). A token's slot in the paged KV cache is block_id * block_size +
offset:

    block_table of a sequence = [7, 2, 9], block_size 4, 10 tokens
    token:   0  1  2  3 | 4  5  6  7 | 8  9
    slot:   28 29 30 31 | 8  9 10 11 |36 37
"""

from __future__ import annotations

import torch

from myvllm.config import Config, resolved_max_model_length
from myvllm.engine.batch import StepInputs
from myvllm.worker import pending_tokens
from myvllm.worker.padded_steps import PaddedSteps
from myvllm.engine.sequence import Sequence
from myvllm.sample.extras import proposals_of
from myvllm.worker.staging import FreshTensors, block_table_array
from myvllm.worker.token_pool import TokenPool
from myvllm.utils.context import Context
from myvllm.utils.device import resolve_device


class InputBuilder:
    """Builds StepInputs for prefill and decode steps (no model needed: the examples use it
    alone to show a step's tensors)."""

    def __init__(self, config: Config, device: torch.device | None = None, rank: int = 0) -> None:
        self.config = config
        self.rank = rank
        self.block_size = config.block_size
        self.device = device if device is not None else resolve_device(config)
        # ceil(max_model_length / block_size): the most blocks one sequence can hold.
        self.max_blocks_per_seq = -(-resolved_max_model_length(config, "InputBuilder")
                                    // self.block_size)
        self.fresh = FreshTensors(self.device)
        # Where each step's sampled tokens land, and a pending token is read.
        self.pool = TokenPool(torch.zeros(config.max_num_sequences, dtype=torch.int64,
                                          device=self.device))
        # GPU: padded_steps.pad_steps switches it on (and replaces the pool by its own).
        self.padded: PaddedSteps | None = None

    def prepare_block_tables(self, seqs: list[Sequence]) -> torch.Tensor:
        """Block tables padded with -1 to a rectangle, as wide as a multiple of 16: Triton
        compiles a kernel variant per "divisible by 16 or not" of each int argument (the
        rows' stride too), and one met first mid-run took ~2 s (worker/warmup.py compiles
        this one)."""
        width = -(-max(len(seq.block_table) for seq in seqs) // 16) * 16
        return self.fresh.tensor(block_table_array([seq.block_table for seq in seqs], width),
                                 torch.int32)

    def prepare_prefill(self, seqs: list[Sequence]) -> StepInputs:
        """A prefill step: each sequence computes its next num_new_tokens tokens, the ones
        just below num_computed_tokens (a whole prompt after its cached prefix, a chunk of
        one, or a decode row's one token), all in one varlen batch (the guide's Step 4 draws
        one). Block tables only when some context is in the cache."""
        input_ids: list[int] = []
        positions: list[int] = []
        cu_seqlens_q, cu_seqlens_k = [0], [0]
        slot_mapping: list[int] = []
        pending: list[tuple[int, int]] = []  # (index in input_ids, row of the pool)
        for seq in seqs:
            end = seq.num_computed_tokens
            start = end - seq.num_new_tokens
            if start == len(seq) - 1:  # a decode row: its last token
                input_ids.append(last_token(seq, len(input_ids), pending))
                if end > len(seq):  # and the proposals it verifies (speculative decoding)
                    input_ids.extend(proposals_of(seq))
            else:  # a chunk of known tokens (a prompt's, or a recomputed one's)
                input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            cu_seqlens_q.append(cu_seqlens_q[-1] + end - start)
            cu_seqlens_k.append(cu_seqlens_k[-1] + end)
            if not seq.block_table:  # the warm-up's made-up sequences: no cache to write to
                continue
            # One range per block, not one Python step per token: a chunk can be 16k long.
            pos = start
            while pos < end:
                offset = pos % self.block_size
                count = min(self.block_size - offset, end - pos)
                first = seq.block_table[pos // self.block_size] * self.block_size + offset
                slot_mapping.extend(range(first, first + count))
                pos += count
        if self.padded is not None and self.padded.chunk_size(len(positions)) is not None:
            return self.padded.prefill(input_ids, pending, positions, slot_mapping,
                                       cu_seqlens_q, cu_seqlens_k,
                                       [seq.block_table for seq in seqs])
        context = Context(
            is_prefill=True,
            cu_seqlens_q=self.fresh.tensor(cu_seqlens_q, torch.int32),
            cu_seqlens_k=self.fresh.tensor(cu_seqlens_k, torch.int32),
            # Host ints: the lengths are known here, so no cu_seqlens.cpu() sync is needed.
            max_seqlen_q=max(seq.num_new_tokens for seq in seqs),
            max_seqlen_k=max(seq.num_computed_tokens for seq in seqs),
            slot_mapping=self.fresh.tensor(slot_mapping, torch.int32),
            block_tables=(self.prepare_block_tables(seqs)
                          if cu_seqlens_k[-1] > cu_seqlens_q[-1] else None),
        )
        return StepInputs(self.input_ids(input_ids, pending),
                          self.fresh.tensor(positions, torch.int64), context)

    def prepare_decode(self, seqs: list[Sequence]) -> StepInputs:
        """One new token per sequence; its K/V goes to the slot after the last one used."""
        pending: list[tuple[int, int]] = []
        input_ids = [last_token(seq, row, pending) for row, seq in enumerate(seqs)]
        positions = [len(seq) - 1 for seq in seqs]
        context_lens = [len(seq) for seq in seqs]
        slot_mapping = [seq.block_table[-1] * self.block_size + seq.last_block_num_tokens - 1
                        for seq in seqs]
        # Only rank 0 samples (a worker's copy of a Sequence carries no sampling_params).
        temperatures = [seq.sampling_params.temperature if self.rank == 0 else 0.0
                        for seq in seqs]
        tables = [seq.block_table for seq in seqs]
        return self.decode_rows(input_ids, pending, positions, slot_mapping, context_lens,
                                temperatures, tables)

    def decode_rows(self, input_ids: list[int], pending: list[tuple[int, int]],
                    positions: list[int], slot_mapping: list[int], context_lens: list[int],
                    temperatures: list[float], tables: list[list[int]]) -> StepInputs:
        """A decode step's host arrays, one entry per row, on the device (padded on a GPU);
        speculative decoding's verification rows too."""
        if self.padded is not None:
            return self.padded.decode(input_ids, pending, positions, slot_mapping,
                                      context_lens, temperatures, tables)
        # Unpadded: a CPU's, which samples outside its forward (ModelRunner.sample_in_graph),
        # so the step carries no temperatures and no place for its tokens.
        block_tables = block_table_array(tables, max(len(table) for table in tables))
        context = Context(is_prefill=False,
                          slot_mapping=self.fresh.tensor(slot_mapping, torch.int32),
                          context_lens=self.fresh.tensor(context_lens, torch.int32),
                          block_tables=self.fresh.tensor(block_tables, torch.int32))
        return StepInputs(self.input_ids(input_ids, pending),
                          self.fresh.tensor(positions, torch.int64), context)

    def input_ids(self, host_ids: list[int], pending: list[tuple[int, int]]) -> torch.Tensor:
        """A step's input ids on the device; any still pending (async scheduling) are read
        from the pool (worker/pending_tokens.py)."""
        if pending:
            return pending_tokens.input_ids(self.pool, self.fresh, host_ids, pending)
        return self.fresh.tensor(host_ids, torch.int64)


def last_token(seq: Sequence, at: int, pending: list[tuple[int, int]]) -> int:
    """The host id of seq's last token, an input at position `at` of the step; one still
    pending (async scheduling) gets a placeholder, and is read from the pool
    (pending_tokens.pending_token)."""
    if not seq.num_pending_tokens:
        return seq.last_token
    return pending_tokens.pending_token(seq, at, pending)
