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
not the prefill path's chunk graph, whose attention runs the prefill kernel and the decode
kernel (for its padding rows) over a step padded to 16 tokens. The logits of all rows are
then exactly logit_rows.

The greedy fast path (every row of the step at temperature 0, nothing that needs the
Sampler: no logprobs, no logits processing, no grammar): a greedy row's tokens follow from
the argmax at its logit rows alone, so the step computes that argmax on the device (one
kernel, no softmax), writes each sequence's last one into the sampled-token pool, copies all
of them back with the step's tokens, and accepts on the host, where the proposals are:

    argmax      g_1 g_2 g_3 g_4          (k = 3; g_j is the target's token after d_{j-1})
    accepted    d_j == g_j for j = 1 .. a, the leading run
    emitted     d_1 .. d_a, g_{a+1}      the same tokens as rejection_sample's greedy rows

The host already waits for the step's tokens, and comparing k + 1 host ints there costs
less than launching the device ops that would do it.
"""

from __future__ import annotations

import torch

from collections.abc import Callable
from typing import Protocol

from myvllm.engine.batch import SamplingArgs, StepInputs
from myvllm.engine.sequence import Sequence
from myvllm.sample.extras import proposals_of
from myvllm.sample.logits_features import LogitsFeatures
from myvllm.sample.sampling_controls import ToDevice, generator_for
from myvllm.spec_decode.rejection_sampler import PLACEHOLDER, rejection_sample
from myvllm.worker.feature_step import (FeatureRunner, forward_prefill_with_features,
                                        sample_with_features)
from myvllm.worker.input_builder import InputBuilder, last_token
from myvllm.worker.staging import FreshTensors, SampledTokens, VerifiedRows
from myvllm.worker.token_pool import TokenPool


class DraftModel(Protocol):
    """speculative_method "draft": the model that fills the proposal slots before the target
    verifies them (spec_decode/draft_proposer.py's DraftProposer), beside rank 0's runner."""

    @property
    def block_bytes(self) -> int: ...

    def warm_up(self) -> None: ...

    def allocate_cache(self, num_blocks: int) -> None: ...

    def propose(self, seqs: list[Sequence]) -> torch.Tensor | None: ...


class Verifier:
    """A ModelRunner's part in speculative decoding (the runner holds None when it is off):
    the VerificationStep of each step that has proposals, and the draft model, if any."""

    def __init__(self, max_rows: int) -> None:
        self.max_rows = max_rows  # the largest decode step (max_num_sequences)
        # speculative_method "draft": set by the EngineCore after it built the runner.
        self.draft: DraftModel | None = None

    def step(self, seqs: list[Sequence], features: LogitsFeatures
             ) -> VerificationStep | None:
        """The step's verification, or None when no row has proposals."""
        if not has_proposals(seqs):
            return None
        return VerificationStep(seqs, self.draft, features, self.max_rows)


class VerifyingRunner(FeatureRunner, Protocol):
    """A ModelRunner (engine/model_runner.py), as a verification step runs on it."""

    broadcast_sampled: bool

    def decode_logits(self, step: StepInputs) -> torch.Tensor | None: ...


class VerificationStep:
    """One step's rows that verify proposals, as ModelRunner.run meets them: where their
    logits are (VerificationRows), a draft model's q, and after sampling their verified
    tokens. Made (Verifier.step) only when some row has proposals."""

    def __init__(self, seqs: list[Sequence], draft: DraftModel | None,
                 features: LogitsFeatures, max_rows: int) -> None:
        self.seqs = seqs
        self.rows = VerificationRows(seqs)
        # A draft model fills the rows' proposal slots first (and gives their q).
        self.draft_probs = draft.propose(seqs) if draft is not None else None
        # Scheduled as a prefill-path step; with no prompt chunk beside them the rows run
        # as decode rows.
        self.as_decode_rows = (not features.prompt_spans
                               and verifies_as_decode(seqs, max_rows))
        self.verified: VerifiedTokens | None = None

    def run(self, runner: VerifyingRunner, features: LogitsFeatures) -> SampledTokens | None:
        """The step on runner, scheduled as a prefill-path step: run as decode rows where it
        can (as_decode_rows); every row greedy: the argmax decides (greedy_verify); else
        rejection sampling in sample_with_features. Rank 0 returns the tokens, other ranks None."""
        if self.as_decode_rows:
            logits = runner.decode_logits(self.decode_step(runner.inputs))
        else:
            logits = forward_prefill_with_features(runner, self.seqs, features, self)
        if (logits is not None and not runner.broadcast_sampled
                and self.greedy_fast_path_applies(features)):
            return self.greedy_verify(logits, runner.inputs.pool, runner.inputs.fresh.tensor)
        return sample_with_features(runner, self.seqs, logits, features, self)

    def decode_step(self, inputs: InputBuilder) -> StepInputs:
        return verification_decode_step(inputs, self.seqs)

    def logits(self, hidden: torch.Tensor,
               compute_logits: Callable[[torch.Tensor], torch.Tensor | None],
               fresh: FreshTensors) -> torch.Tensor | None:
        """The LM head over the logit rows of a prefill-path step's hidden states. Call it
        outside the forward context, where the LM head keeps every row it is given
        (collective under tensor parallelism: every rank has the same rows)."""
        return compute_logits(hidden[fresh.tensor(self.rows.logit_rows, torch.int64)])

    def greedy_fast_path_applies(self, features: LogitsFeatures) -> bool:
        return greedy_fast_path_applies(self.seqs, features.processing,
                                        bool(features.prompt_spans))

    def greedy_verify(self, logits: torch.Tensor, pool: TokenPool, to_device: ToDevice
                      ) -> SampledTokens:
        return greedy_verify(self.seqs, self.rows, logits, pool, to_device)

    def verify(self, logits: torch.Tensor, args: SamplingArgs, to_device: ToDevice
               ) -> torch.Tensor:
        """Rejection sampling of the rows with proposals (their tokens in self.verified);
        returns the logits of each row's last position, which the step's
        one-token-per-row sampling reads."""
        self.verified = VerifiedTokens(*verify(self.seqs, self.rows, logits, args, to_device,
                                               self.draft_probs))
        return logits[to_device(self.rows.last_rows, torch.int64)]


def has_proposals(seqs: list[Sequence]) -> bool:
    return any(seq.extras is not None and seq.extras.spec_token_ids for seq in seqs)


def verifies_as_decode(seqs: list[Sequence], max_rows: int) -> bool:
    """Whether the step's rows are all decode or verification rows (no prompt chunk), and
    their k + 1 decode rows each fit in max_rows (the largest decode step)."""
    rows = 0
    for seq in seqs:
        new = 1 + len(proposals_of(seq))
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
        input_ids.append(last_token(seq, len(input_ids), pending))
        input_ids.extend(proposals_of(seq))
        first = seq.num_tokens - 1
        positions.extend(range(first, first + 1 + len(proposals_of(seq))))
        tables.extend([seq.block_table] * (1 + len(proposals_of(seq))))
        # Only rank 0 samples (a worker's copy of a Sequence carries no sampling_params).
        temperature = seq.sampling_params.temperature if inputs.rank == 0 else 0.0
        temperatures.extend([temperature] * (1 + len(proposals_of(seq))))
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
            first = end - 1 - len(proposals_of(seq))
            self.first_rows.append(len(self.logit_rows))
            self.logit_rows.extend(range(first, end))
            self.last_rows.append(len(self.logit_rows) - 1)
        # Padded with row 0 to a power of two, as kernels/linear_kernels.py's
        # pad_rows_to_power_of_two pads a prefill's LM-head rows: cuBLAS loads a kernel per
        # matrix shape the first time it meets it (3.5 ms of host time on the H200), and the
        # count of verification rows varies from step to step. Nobody reads the padding's
        # logits.
        num_rows = len(self.logit_rows)
        self.logit_rows += [0] * ((1 << (num_rows - 1).bit_length()) - num_rows)


def verify(seqs: list[Sequence], rows: VerificationRows, logits: torch.Tensor,
           args: SamplingArgs, to_device: ToDevice, draft_probs: torch.Tensor | None = None
           ) -> tuple[list[int], torch.Tensor]:
    """Rejection sampling of the rows with proposals (args: the step's, one per sequence;
    draft_probs: a draft model's q [rows with proposals, k, vocab], None for prompt lookup).
    Returns (their indices in seqs, their emitted tokens [len, k+1] int64 on the device,
    PLACEHOLDER padded)."""
    spec = [i for i, seq in enumerate(seqs) if proposals_of(seq)]
    k = max(len(proposals_of(seqs[i])) for i in spec)
    # Each row's k + 1 logit rows, a row with fewer proposals padded with its last one.
    index = [min(rows.first_rows[i] + j, rows.last_rows[i]) for i in spec for j in range(k + 1)]
    target = logits[to_device(index, torch.int64)].view(len(spec), k + 1, -1)
    drafts = [proposals_of(seqs[i]) + [0] * (k - len(proposals_of(seqs[i]))) for i in spec]
    at = to_device(spec, torch.int64)
    generators = None
    if any(seqs[i].sampling_params.seed is not None for i in spec):
        generators = [generator_for(seqs[i], logits.device) for i in spec]
    emitted = rejection_sample(
        target, to_device(sum(drafts, []), torch.int64).view(len(spec), k),
        [len(proposals_of(seqs[i])) for i in spec], args.temperatures[at],
        args.top_ks[at] if args.top_ks is not None else None,
        args.top_ps[at] if args.top_ps is not None else None,
        generators, draft_probs, all_greedy=args.all_greedy)
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


def verified_token_lists(verified: VerifiedRows | None, sampling: list[int]
                         ) -> dict[int, list[int]] | None:
    """{j: the emitted tokens of sampling[j]} for the rows of a read-back step that verified
    proposals (sampling: the indices in the step's seqs of the rows that sampled), or None
    when none did."""
    if verified is None:
        return None
    by_row = verified.token_lists()
    return {j: by_row[i] for j, i in enumerate(sampling) if i in by_row}


def greedy_fast_path_applies(seqs: list[Sequence], processing: object | None,
                             has_prompt_logprobs: bool) -> bool:
    """Every row greedy, and none that needs the Sampler or the logits after it."""
    return (processing is None and not has_prompt_logprobs
            and all(seq.sampling_params.temperature == 0
                    and seq.sampling_params.logprobs is None
                    and (seq.extras is None or seq.extras.grammar_matcher is None)
                    for seq in seqs))


def greedy_verify(seqs: list[Sequence], rows: VerificationRows, logits: torch.Tensor,
                  pool: TokenPool, to_device: ToDevice) -> SampledTokens:
    """The greedy fast path of a step with verification rows (logits: one per logit row):
    the pool gets each sequence's token, the host the argmax of every logit row; returns
    the step's SampledTokens, with the verified tokens."""
    greedy = logits.argmax(dim=-1)
    num_seqs = len(seqs)
    torch.index_select(greedy, 0, to_device(rows.last_rows, torch.int64),
                       out=pool.tokens[:num_seqs])
    # Queued before the pool's copy: token_ids() waits for both.
    verified = GreedyVerifiedTokens(seqs, rows, greedy)
    sampled = pool.read_back(seqs)
    sampled.verified = verified
    return sampled


def accept_greedy(drafts: list[int], greedy: list[int]) -> list[int]:
    """drafts d_1..d_k, greedy g_1..g_{k+1} (the argmax at the row's k + 1 positions) ->
    the accepted proposals, then the target's own token."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == greedy[accepted]:
        accepted += 1
    return drafts[:accepted] + [greedy[accepted]]


class GreedyVerifiedTokens(VerifiedTokens):
    """The argmax of every logit row on its way to the host; the rows' tokens follow from
    it and the proposals (accept_greedy)."""

    def __init__(self, seqs: list[Sequence], rows: VerificationRows,
                 greedy: torch.Tensor) -> None:
        indices = [i for i, seq in enumerate(seqs) if proposals_of(seq)]
        super().__init__(indices, greedy)
        self.drafts = [list(proposals_of(seqs[i])) for i in indices]
        self.first_rows = [rows.first_rows[i] for i in indices]

    def token_lists(self) -> dict[int, list[int]]:
        greedy = self.host.tolist()
        return {i: accept_greedy(drafts, greedy[first:first + len(drafts) + 1])
                for i, drafts, first in zip(self.indices, self.drafts, self.first_rows,
                                            strict=True)}
