"""Logprobs on their way from the device to a request's output.

    ModelRunner.run (rank 0, on the device)
      sampled rows: the step's logits of the rows that sampled and asked (logprobs)
      prompt rows:  the LM head over the prompt rows of requests that asked
                    (prompt_logprobs), which the sampling LM head skips
      -> gather_logprobs (layers/logprobs.py) -> StepLogprobs, copied to the host with the
         step's tokens (SampledTokens)
    EngineCore.read_back, request_outputs
      -> per request: LogprobsLists in its RequestOutput (and CoreOutput, over the socket)

Row r of a prefill chunk holds the logits after token r, which predict token r + 1: a chunk
over prompt positions [start, end) gives the logprobs of prompt tokens start + 1 .. end - 1,
and of token end too when the prompt goes on (the next chunk's first token). Every prompt
token but the first is covered exactly once over the chunks; the first has no logprob.

A request that wants nothing costs nothing: no rows, no copies, None in its outputs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from myvllm.engine.batch import RequestOutput
from myvllm.sample.extras import LogprobsLists
from myvllm.sample.extras import extras_of
from myvllm.sample.sampling_controls import ToDevice
from myvllm.engine.sequence import Sequence
from myvllm.layers.logprobs import gather_logprobs


@dataclass
class LogprobRows:
    """gather_logprobs' three tensors for some rows: on the device, then on the host."""

    logprobs: torch.Tensor  # [R] float32
    top_ids: torch.Tensor  # [R, k] int64
    top_logprobs: torch.Tensor  # [R, k] float32

    def to_host(self) -> LogprobRows:
        """Queue the copies to pinned host memory (GPU; the caller records the event that
        says they are done), or keep the tensors (CPU: the step has run)."""
        if not self.logprobs.is_cuda:
            return self
        return LogprobRows(*(_pinned_copy(t) for t in
                             (self.logprobs, self.top_ids, self.top_logprobs)))

    def lists(self, spans: list[tuple[int, int, int]]) -> list[LogprobsLists]:
        """Host rows [start, start + count) with the first k alternatives, per (start,
        count, k): one .tolist() per tensor for the whole step, not one per request."""
        logprobs, ids, top = (self.logprobs.tolist(), self.top_ids.tolist(),
                              self.top_logprobs.tolist())
        return [LogprobsLists(logprobs[start:start + count],
                              [row[:k] for row in ids[start:start + count]],
                              [row[:k] for row in top[start:start + count]])
                for start, count, k in spans]


def _pinned_copy(t: torch.Tensor) -> torch.Tensor:
    # Pinned, so that the copy runs on the stream without the host waiting for it (torch's
    # caching host allocator reuses these buffers from step to step).
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


@dataclass
class PromptSpan:
    """One request's prompt rows in a step: row `row` of the step's hidden states predicts
    prompt token `position`, the next count rows the tokens after it."""

    seq_index: int  # in the step's batch
    row: int
    position: int
    count: int


@dataclass
class StepLogprobs:
    """What one step computed for the requests that asked; rows of `sampled` follow
    `sampled_seqs` (indices in the step's batch), rows of `prompt` the spans in order."""

    sampled_seqs: list[int]
    sampled: LogprobRows | None
    prompt_spans: list[PromptSpan]
    prompt: LogprobRows | None

    def to_host(self) -> StepLogprobs:
        return StepLogprobs(self.sampled_seqs, self.sampled and self.sampled.to_host(),
                            self.prompt_spans, self.prompt and self.prompt.to_host())


def wants_logprobs(seq: Sequence) -> bool:
    return seq.sampling_params.logprobs is not None


def prompt_spans(seqs: list[Sequence]) -> list[PromptSpan]:
    """The rows of a prefill step whose logits give prompt logprobs: for each sequence that
    still needs them (SequenceExtras.needs_prompt_logprobs: known on every tensor-parallel
    rank, as the LM head over them is collective), its chunk's rows up to the prompt's
    second-last token (the last row predicts the first completion token: that is
    sampling's)."""
    spans = []
    row = 0
    for i, seq in enumerate(seqs):
        start = seq.num_computed_tokens - seq.num_new_tokens
        end = min(seq.num_computed_tokens, seq.num_prompt_tokens - 1)
        if seq.extras is not None and seq.extras.needs_prompt_logprobs and end > start:
            spans.append(PromptSpan(i, row, start + 1, end - start))
        row += seq.num_new_tokens
    return spans


def sampled_logprobs(seqs: list[Sequence], samples: list[bool], logits: torch.Tensor,
                     tokens: torch.Tensor, to_device: ToDevice
                     ) -> tuple[list[int], LogprobRows | None]:
    """The logprobs of the tokens just sampled, for the rows that asked and sample this step
    (samples; a chunk that stops short of its prompt's end samples nothing): (their indices
    in the batch, their rows), or ([], None)."""
    asked = [i for i, (seq, sample) in enumerate(zip(seqs, samples, strict=True))
             if sample and wants_logprobs(seq)]
    if not asked:
        return [], None
    k = max(seqs[i].sampling_params.logprobs or 0 for i in asked)
    rows = to_device(asked, torch.int64)
    return asked, LogprobRows(*gather_logprobs(logits[rows], tokens[rows], k))


def prompt_logprobs(seqs: list[Sequence], spans: list[PromptSpan], hidden: torch.Tensor,
                    compute_logits: Callable[[torch.Tensor], torch.Tensor | None],
                    to_device: ToDevice, max_rows: int) -> LogprobRows | None:
    """The LM head over the spans' rows of a prefill's hidden states, and their logprobs
    (rank 0; None elsewhere, where the LM head only contributes its vocabulary slice).

    Called outside forward_context: with no step context the LM head keeps every row it is
    given, not each sequence's last. In pieces of max_rows rows (max_num_sequences: the
    sampler's warm-up measured that many rows of float32 logits, so the KV cache left room
    for them), as a 2,048-token chunk's logits alone would be 1.2 GB for a 150k vocabulary.
    """
    rows = [span.row + j for span in spans for j in range(span.count)]
    rows_on_device = to_device(rows, torch.int64)
    targets: torch.Tensor | None = None
    k = 0
    pieces = []
    for start in range(0, len(rows), max_rows):
        logits = compute_logits(hidden[rows_on_device[start:start + max_rows]])
        if logits is None:
            continue  # not rank 0, whose sequences alone carry their tokens' params
        if targets is None:
            targets = to_device([seqs[span.seq_index].token_ids[span.position + j]
                                 for span in spans for j in range(span.count)], torch.int64)
            k = max(seqs[span.seq_index].sampling_params.prompt_logprobs or 0
                    for span in spans)
        pieces.append(gather_logprobs(logits, targets[start:start + max_rows], k))
    if not pieces:
        return None
    return LogprobRows(*(torch.cat(parts) for parts in zip(*pieces, strict=True)))


def read_step_logprobs(seqs: list[Sequence], step: StepLogprobs, sampling: list[int]
                       ) -> list[LogprobsLists | None]:
    """On the host, once the step's copy arrived: each prompt span's rows are appended to its
    sequence's prompt_logprobs, and the sampled rows returned, one per index of `sampling`
    (the rows of seqs that sample in the step; None for one that asked for none).

    A span may repeat rows already read (a preempted sequence's prompt computed again while
    the first pass was still in flight); only positions not yet known are kept.
    """
    if step.prompt is not None:
        offsets = [0]
        for span in step.prompt_spans:
            offsets.append(offsets[-1] + span.count)
        spans = [(offset, span.count, seqs[span.seq_index].sampling_params.prompt_logprobs or 0)
                 for offset, span in zip(offsets, step.prompt_spans)]
        for span, lists in zip(step.prompt_spans, step.prompt.lists(spans), strict=True):
            seq = seqs[span.seq_index]
            extras = seq.extras
            known = extras.prompt_logprobs if extras is not None else None
            if extras is None or known is None:  # already handed out
                continue
            next_position = len(known) + 1
            if span.position <= next_position:
                known.extend(lists.slice(next_position - span.position, span.count))
            if len(known) + 1 >= seq.num_prompt_tokens:
                extras.needs_prompt_logprobs = False
    if step.sampled is None:
        return [None] * len(sampling)
    ks = [seqs[i].sampling_params.logprobs or 0 for i in step.sampled_seqs]
    rows = step.sampled.lists([(row, 1, k) for row, k in enumerate(ks)])
    by_index = dict(zip(step.sampled_seqs, rows, strict=True))
    return [by_index.get(i) for i in sampling]


def take_prompt_logprobs(seq: Sequence, completions: list[Sequence]) -> LogprobsLists | None:
    """The prompt logprobs for seq's first output, if it asked (then nothing more to send).
    completions: its request's sequences; with n > 1 the other completions' first outputs
    come in this step (after seq's: they were admitted after it) or later, and carry them
    too."""
    extras = seq.extras
    if extras is None or extras.prompt_logprobs is None:
        return None
    lists, extras.prompt_logprobs = extras.prompt_logprobs, None
    extras.needs_prompt_logprobs = False
    if seq.index == 0:
        for fork in completions[1:]:
            extras_of(fork).prompt_logprobs = lists
    return lists


def logprob_dicts(token_ids: list[int], lists: LogprobsLists) -> list[dict[int, float]]:
    """Per token, {token id: logprob} of the token itself and its alternatives (vLLM's
    shape of LLM.generate's logprobs, without the Logprob objects)."""
    return [{token_id: logprob, **dict(zip(ids, top, strict=True))}
            for token_id, logprob, ids, top in zip(token_ids, lists.logprobs,
                                                   lists.top_token_ids, lists.top_logprobs,
                                                   strict=True)]


@dataclass
class LogprobsCollector:
    """One request's logprobs gathered over its outputs, for LLM.generate's dicts."""

    prompt_token_ids: list[int]
    completion: LogprobsLists | None  # None: not asked
    prompt: LogprobsLists | None = None

    def add(self, out: RequestOutput) -> None:
        if out.logprobs is not None and self.completion is not None:
            self.completion.extend(out.logprobs)
        if out.prompt_logprobs is not None:
            self.prompt = out.prompt_logprobs

    def result(self, token_ids: list[int]) -> dict[str, Any]:
        """"logprobs": one dict per completion token; "prompt_logprobs": None for the
        first prompt token, then one dict each (either None when not asked)."""
        prompt = None
        if self.prompt is not None:
            prompt = [None, *logprob_dicts(self.prompt_token_ids[1:], self.prompt)]
        return {"logprobs": None if self.completion is None
                else logprob_dicts(token_ids, self.completion),
                "prompt_logprobs": prompt}
