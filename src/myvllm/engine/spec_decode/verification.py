"""The model runner's side of speculative decoding: a verification row is a chunk that
samples at every position.

A decode row with k proposals is scheduled as k + 1 new tokens, its last token and the
proposals, over its cached context (the prefill path: cu_seqlens and the paged cache):

    input_ids   [... | t_last d_1 d_2 d_3 | ...]     one row of the batch, k = 3
    logits      p_1   p_2 p_3 p_4                    p_j: the target's next-token
                                                     distribution after d_{j-1}

A plain row needs the logits of its last token only; a verification row those of all its
k + 1 tokens. The LM head then runs outside the forward context (where it keeps every row
it is given) on exactly those rows (logit_rows); the step's usual one-token-per-row
sampling reads the last of each row's (last_rows), and rejection_sample reads the rest.

When every row of the step is a decode row or a verification row (no prompt chunk beside
them, the usual case while generating), the step runs as a decode step instead:
a verification row becomes k + 1 decode rows that share its block table, row j attending
to the context up to its own position (its K/V and those before it are stored first):

    decode rows   t_last   d_1      d_2      d_3
    position      n-1      n        n+1      n+2
    context_len   n        n+1      n+2      n+3

That is the decode path's kernels and CUDA graphs (padded to a decode graph batch size),
which on a GPU cost a few decode rows more than plain decoding, where the prefill path's
chunk graph costs several times that. The logits of all rows are then exactly logit_rows.
"""

from __future__ import annotations

import torch

from myvllm.engine.batch import SamplingArgs, StepInputs
from myvllm.engine.input_builder import InputBuilder
from myvllm.engine.sampling import ToDevice, generator_for
from myvllm.engine.sequence import Sequence
from myvllm.engine.spec_decode.rejection_sampler import PLACEHOLDER, rejection_sample


def has_proposals(seqs: list[Sequence]) -> bool:
    return any(seq.spec_token_ids for seq in seqs)


def verifies_as_decode(seqs: list[Sequence], max_rows: int) -> bool:
    """Whether the step's rows are all decode or verification rows (no prompt chunk), and
    their k + 1 decode rows each fit in max_rows (the largest decode step)."""
    rows = 0
    for seq in seqs:
        new = 1 + len(seq.spec_token_ids)
        if seq.num_new_tokens != new or seq.num_computed_tokens != seq.num_tokens - 1 + new:
            return False
        rows += new
    return rows <= max_rows


def verification_decode_step(inputs: InputBuilder, seqs: list[Sequence]) -> StepInputs:
    """The step's rows as decode rows: a verification row's last token and its proposals
    each a row of its own (see the module docstring)."""
    block_size = inputs.block_size
    pending: list[tuple[int, int]] = []
    input_ids: list[int] = []
    positions: list[int] = []
    tables: list[list[int]] = []
    temperatures: list[float] = []
    for seq in seqs:
        input_ids.append(inputs.pool.last_token(seq, len(input_ids), pending))
        input_ids.extend(seq.spec_token_ids)
        first = seq.num_tokens - 1
        positions.extend(range(first, first + 1 + len(seq.spec_token_ids)))
        tables.extend([seq.block_table] * (1 + len(seq.spec_token_ids)))
        # Only rank 0 samples (a worker's copy of a Sequence carries no sampling_params).
        temperature = seq.sampling_params.temperature if inputs.rank == 0 else 0.0
        temperatures.extend([temperature] * (1 + len(seq.spec_token_ids)))
    slot_mapping = [table[pos // block_size] * block_size + pos % block_size
                    for table, pos in zip(tables, positions, strict=True)]
    context_lens = [pos + 1 for pos in positions]
    return inputs.decode_rows(input_ids, pending, positions, slot_mapping, context_lens,
                              temperatures, tables)


class VerificationRows:
    """Where a step's logits are needed in its flat batch, and where they land."""

    def __init__(self, seqs: list[Sequence]) -> None:
        self.logit_rows: list[int] = []  # rows of the flat batch the LM head reads
        self.last_rows: list[int] = []  # per sequence, its last row among logit_rows
        self.first_rows: list[int] = []  # per sequence, its first row among logit_rows
        end = 0
        for seq in seqs:
            end += seq.num_new_tokens
            first = end - 1 - len(seq.spec_token_ids)
            self.first_rows.append(len(self.logit_rows))
            self.logit_rows.extend(range(first, end))
            self.last_rows.append(len(self.logit_rows) - 1)


def verify(seqs: list[Sequence], rows: VerificationRows, logits: torch.Tensor,
           args: SamplingArgs, to_device: ToDevice) -> tuple[list[int], torch.Tensor]:
    """Rejection sampling of the rows with proposals (args: the step's, one per sequence).
    Returns (their indices in seqs, their emitted tokens [len, k+1] int64 on the device,
    PLACEHOLDER padded)."""
    spec = [i for i, seq in enumerate(seqs) if seq.spec_token_ids]
    k = max(len(seqs[i].spec_token_ids) for i in spec)
    # Each row's k + 1 logit rows, a row with fewer proposals padded with its last one.
    index = [min(rows.first_rows[i] + j, rows.last_rows[i]) for i in spec for j in range(k + 1)]
    target = logits[to_device(index, torch.int64)].view(len(spec), k + 1, -1)
    drafts = [seqs[i].spec_token_ids + [0] * (k - len(seqs[i].spec_token_ids)) for i in spec]
    at = to_device(spec, torch.int64)
    generators = None
    if any(seqs[i].sampling_params.seed is not None for i in spec):
        generators = [generator_for(seqs[i], logits.device) for i in spec]
    emitted = rejection_sample(
        target, to_device(sum(drafts, []), torch.int64).view(len(spec), k),
        [len(seqs[i].spec_token_ids) for i in spec], args.temperatures[at],
        args.top_ks[at] if args.top_ks is not None else None,
        args.top_ps[at] if args.top_ps is not None else None,
        generators, all_greedy=args.all_greedy)
    return spec, emitted


class VerifiedTokens:
    """The emitted tokens of a step's verification rows, on their way to the host (queued
    before the step's token copy, so SampledTokens.token_ids() has waited for them too)."""

    def __init__(self, indices: list[int], emitted: torch.Tensor) -> None:
        self.indices = indices
        if emitted.is_cuda:
            host = torch.empty(emitted.shape, dtype=emitted.dtype, pin_memory=True)
            self.host = host.copy_(emitted, non_blocking=True)
        else:
            self.host = emitted.clone()

    def token_lists(self) -> dict[int, list[int]]:
        """{index in the step's seqs: its emitted tokens}; call after token_ids()."""
        return {i: [t for t in row if t != PLACEHOLDER]
                for i, row in zip(self.indices, self.host.tolist(), strict=True)}
