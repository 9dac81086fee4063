"""Scheduler: which sequences run in the next forward pass, and whether it is a prefill.

Two queues, waiting and running, and four rules (the guide's Step 5): 1. prefill first,
2. prefills batched FIFO within the step's budgets, 3. preemption by recompute, of the tail
of running, to the front of waiting, 4. no progress while work remains is an error.
Rules 1 and 2 are Config(enable_chunked_prefill=False); the default replaces them by a token
budget (StepBudget, below; Step 5b): decode rows first, then chunks of prompts.

Each optional feature enters through one check of its own, which a plain request fails:
speculative decoding through `self.speculator is not None` (spec_decode/scheduling.py); the
other completions of an n > 1 request, and a request's own stop tokens and min_tokens, through
`seq.extras is not None` (sample/forks.py, sample/sampling_controls.py).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from myvllm.config import (Config, resolved_max_model_length, sized_num_kvcache_blocks,
                            stop_token_ids)
from myvllm.engine.block_manager import BlockManager
from myvllm.engine.capped_chunks import capped_chunk_size
from myvllm.engine.request_checks import check_schedulable, no_progress_error
from myvllm.engine.sequence import FinishReason, Sequence, SequenceStatus
from myvllm.sample.forks import admit, can_admit, release_forks
from myvllm.sample.sampling_controls import is_stop_token
from myvllm.worker.pending_tokens import drop_pending_tokens
from myvllm.spec_decode.scheduling import Speculator, make_speculator, propose_for_row


@dataclass
class StepBudget:
    """What is left of one step's tokens: all of them (decode rows and chunks), the share
    prompt chunks may take, and whether that share is capped (streams decoding beside).

    The step has max_num_batched_tokens tokens for decode rows and prompt chunks. While a
    streamed sequence decodes (Sequence.streamed), prompt chunks together get at most
    max_prefill_tokens_while_decoding of them, so that the decode rows' step stays short,
    and two corrections make every such capped step about as long (the guide's "The cap
    beside decode rows" measures them; engine/capped_chunks.py makes them):

    - A chunk's attention grows with its position, so past ATTENTION_BOUND_CONTEXT a chunk
      of n tokens ending at position p costs n * p / ATTENTION_BOUND_CONTEXT of the cap.
    - The prefill kernel computes queries in tiles of CHUNK_TILE rows, and a started tile
      costs a whole one, so a capped chunk that is not its prompt's last is cut to whole
      tiles (take_chunk).
    """

    tokens: int
    prompt: int
    capped: bool

    @classmethod
    def for_step(cls, max_num_batched_tokens: int, cap: int, chunked: bool,
                 running: Iterable[Sequence]) -> StepBudget:
        """The budget of a step about to be scheduled: capped by cap (chunked prefill only)
        while a streamed running sequence decodes."""
        capped = (chunked and bool(cap)
                  and any(seq.streamed and seq.num_tokens - seq.num_computed_tokens <= 1
                          for seq in running))
        tokens = max_num_batched_tokens
        return cls(tokens, min(tokens, cap) if capped else tokens, capped)

    def take_chunk(self, start: int, remaining: int) -> int:
        """The length of the next chunk of a prompt at position `start` with `remaining`
        tokens to go, taken out of the budget (capped: at its cost, as
        engine/capped_chunks.py costs and cuts it)."""
        if self.capped:
            chunk, cost = capped_chunk_size(start, remaining, self.tokens, self.prompt)
        else:
            chunk = cost = min(remaining, self.tokens, self.prompt)
        self.tokens -= chunk
        self.prompt -= cost
        return chunk


class Scheduler:
    def __init__(self, config: Config, speculator: Speculator | None = None) -> None:
        # Built once the KV cache is sized and max_model_length known (config.py checks both).
        self.block_manager: BlockManager = BlockManager(
            sized_num_kvcache_blocks(config, "Scheduler"), config.block_size,
            config.enable_prefix_caching)
        self.max_num_sequences: int = config.max_num_sequences
        self.max_num_batched_tokens: int = config.max_num_batched_tokens
        self.max_prefill_tokens_while_decoding = config.max_prefill_tokens_while_decoding
        self.max_model_length: int = resolved_max_model_length(config, "Scheduler")
        self.enable_chunked_prefill: bool = config.enable_chunked_prefill
        self.block_size: int = config.block_size
        self.eos_token_ids: frozenset[int] = stop_token_ids(config.eos)
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        # Speculative decoding: proposals for decode rows (None: off). The EngineCore hands
        # it in; a Scheduler made alone makes its own when the config asks for one.
        self.speculator: Speculator | None = (speculator if speculator is not None
                                              else make_speculator(config))

    # ------------------------------------------------------------------ admission
    def check_sequence(self, seq: Sequence) -> None:
        """Raise ValueError if seq could never run here; queue nothing."""
        check_schedulable(seq, self)

    def add_sequence(self, seq: Sequence) -> None:
        """Queue a request. With SamplingParams.n > 1, seq is its first completion and its
        caller (EngineCore.add_sequence) makes the others, which wait in seq.extras.forks
        until seq's prompt is scheduled (sample/forks.py)."""
        self.check_sequence(seq)
        self.waiting.append(seq)

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    # ------------------------------------------------------------------ scheduling
    def schedule(self) -> tuple[list[Sequence], bool]:
        """Pick the next batch under a StepBudget, one loop for both policies (the guide's
        Steps 5 and 5b); the flag is False only for a pure decode step. Never empty while work
        remains, unless it waits for the step in flight (async scheduling)."""
        if self.is_finished():
            return [], False
        budget = StepBudget.for_step(self.max_num_batched_tokens,
                                     self.max_prefill_tokens_while_decoding,
                                     self.enable_chunked_prefill, self.running)
        scheduled: list[Sequence] = []
        if not self.enable_chunked_prefill:
            self._admit_waiting(budget, scheduled, whole_prompts=True)  # rule 1
            if scheduled:
                return scheduled, True
        preempted = self._schedule_running(budget, scheduled)
        if self.enable_chunked_prefill:
            self._admit_waiting(budget, scheduled, whole_prompts=False)
        if scheduled:
            decode_only = all(seq.num_new_tokens == 1 and seq.num_computed_tokens == len(seq)
                              for seq in scheduled)
            return scheduled, not decode_only
        if any(seq.num_pending_tokens for seq in (*self.running, *self.waiting)):
            # Overlapped scheduling: nothing can run until the step in flight is read back
            # (it frees blocks, finishes sequences, resolves the tokens a prefill needs).
            return [], False
        if not preempted:
            raise no_progress_error(self)  # rule 4
        # Everything running was preempted (only one sequence was left and it could not grow).
        # Its blocks are free now, so try again: the next call prefills it or raises above.
        return self.schedule()

    def _schedule_running(self, budget: StepBudget, scheduled: list[Sequence]) -> bool:
        """The running sequences' decode rows and next chunks; whether any was preempted."""
        preempted = False
        visited: list[Sequence] = []  # running sequences looked at, in their order
        while self.running and budget.tokens > 0 and len(scheduled) < self.max_num_sequences:
            seq = self.running.popleft()
            visited.append(seq)
            remaining = seq.num_tokens - seq.num_computed_tokens
            if remaining == 0:
                continue  # its last chunk ran; its token is still in flight (async)
            if remaining > 1:  # a prompt part-way through its prefill
                if budget.prompt == 0:
                    continue  # its next chunk waits; it keeps its place in running
                self._schedule_chunk(seq, budget.take_chunk(seq.num_computed_tokens, remaining))
            else:  # a decode row: the last token's K/V, and maybe a new block for it
                if seq.num_pending_tokens and self.reaches_stop_length(seq, seq.num_tokens):
                    continue  # its pending token is its last one (async)
                num_proposals = 0 if self.speculator is None else propose_for_row(
                    self.speculator, self.block_manager, seq, self.max_model_length,
                    budget.tokens)
                while not self.block_manager.can_append(seq):
                    preempted = True  # rule 3: the tail of running makes room
                    victim = self.running.pop() if self.running else seq
                    self.preempt(victim)
                    if victim is seq:
                        break  # nothing else was left to take from: seq itself waits
                if seq.status != SequenceStatus.RUNNING:
                    visited.remove(seq)
                    continue
                self.block_manager.append(seq, num_lookahead=num_proposals)
                self._schedule_chunk(seq, 1 + num_proposals)
                budget.tokens -= 1 + num_proposals
            scheduled.append(seq)
        # The visited ones go back in front, in their order; any beyond max_num_sequences
        # keep their places behind them.
        self.running.extendleft(reversed(visited))
        return preempted

    def _admit_waiting(self, budget: StepBudget, scheduled: list[Sequence],
                       whole_prompts: bool) -> None:
        """Admit from the head of waiting, FIFO, while budget, sequence slots and blocks last.
        whole_prompts (prefill first): a prompt must fit the budget whole, its cached prefix
        counted (as it is when prefilled again after a preemption)."""
        while (self.waiting and min(budget.tokens, budget.prompt) > 0
               and len(self.running) < self.max_num_sequences
               and len(scheduled) < self.max_num_sequences):
            seq = self.waiting[0]
            # With extras it may be an n > 1 fork: it shares its first completion's prompt
            # blocks (sample/forks.py).
            if (seq.num_pending_tokens  # preempted while its last token was in flight
                    or (whole_prompts and len(seq) > budget.tokens)
                    or not (can_admit(self.block_manager, seq) if seq.extras is not None
                            else self.block_manager.can_allocate(seq))):
                break
            self.waiting.popleft()
            if seq.extras is not None:
                admit(self.block_manager, seq)
            else:
                # Register no fresh block yet: _schedule_chunk registers what the chunk writes.
                self.block_manager.allocate(seq, num_computable=0)
            if seq.num_cached_prompt_tokens is None:  # first admission
                seq.num_cached_prompt_tokens = seq.num_cached_tokens
            seq.status = SequenceStatus.RUNNING
            seq.num_computed_tokens = seq.num_cached_tokens
            if whole_prompts:
                self._schedule_chunk(seq, len(seq) - seq.num_cached_tokens)
                budget.tokens -= len(seq)
            else:
                self._schedule_chunk(seq, budget.take_chunk(seq.num_computed_tokens,
                                                            len(seq) - seq.num_computed_tokens))
            self.running.append(seq)
            scheduled.append(seq)

    def _schedule_chunk(self, seq: Sequence, num_tokens: int) -> None:
        """seq computes its next num_tokens tokens in this step. The blocks those fill are
        registered now: no later step can read them before this one writes them."""
        seq.num_new_tokens = num_tokens
        seq.num_computed_tokens += num_tokens
        self.block_manager.register_full_blocks(seq, num_written=seq.num_computed_tokens)
        if (seq.extras is not None and seq.extras.forks
                and seq.num_computed_tokens == seq.num_tokens):
            # Its prompt's K/V is written by this step at the latest: its forks may share it.
            release_forks(seq, self.waiting)

    def preempt(self, seq: Sequence) -> None:
        """Recompute preemption: free seq's blocks (no K/V copied), put it FIRST in waiting."""
        if seq in self.running:  # the scheduler pops victims itself; direct callers may not
            self.running.remove(seq)
        self.block_manager.deallocate(seq)
        seq.reset_for_recompute()
        self.waiting.appendleft(seq)

    # ------------------------------------------------------------------ after the forward
    def reaches_stop_length(self, seq: Sequence, num_tokens: int) -> bool:
        """Would seq at num_tokens tokens have reached max_tokens or max_model_length?"""
        return (num_tokens - seq.num_prompt_tokens >= seq.sampling_params.max_tokens
                or num_tokens >= self.max_model_length)

    def is_stop_token(self, seq: Sequence, token_id: int) -> bool:
        """eos, unless ignore_eos. A request with extras may also stop on its own
        stop_token_ids, and on nothing before min_tokens (sample/sampling_controls.py)."""
        if seq.extras is not None:
            return is_stop_token(seq, token_id, self.eos_token_ids)
        return not seq.sampling_params.ignore_eos and token_id in self.eos_token_ids

    def postprocess(self, seqs: list[Sequence], token_ids: list[int],
                    verified: dict[int, list[int]] | None = None) -> list[Sequence]:
        """Append each sequence's new token, finish the ones that stop; returns those. One
        already finished (overlapped scheduling) drops its surplus token. verified
        (speculative decoding): per row index, the tokens a verification row emitted, which
        the speculator appends (Speculator.postprocess_row)."""
        if len(seqs) != len(token_ids):
            raise ValueError(f"postprocess got {len(token_ids)} tokens for {len(seqs)} sequences")
        finished: list[Sequence] = []
        for i, (seq, token_id) in enumerate(zip(seqs, token_ids, strict=True)):
            if seq.is_finished:
                continue
            if self.speculator is not None and self.speculator.carried_proposals(seq):
                self.speculator.postprocess_row(seq, verified, i, self.append_and_check_stop,
                                                self.block_manager)
            else:
                self.append_and_check_stop(seq, token_id)
            if seq.is_finished:
                finished.append(seq)
            elif seq.block_table:
                # The token just read may complete a block whose last slot a step already
                # queued is writing (overlapped scheduling); the newest position is written
                # by the next step, so it does not count yet.
                self.block_manager.register_full_blocks(seq, num_written=seq.num_tokens - 1)
        return finished

    def append_and_check_stop(self, seq: Sequence, token_id: int) -> None:
        """Append seq's next token, and finish seq if it stops there."""
        seq.append_token(token_id)
        if self.is_stop_token(seq, token_id):
            self.finish(seq, "stop")
        elif self.reaches_stop_length(seq, len(seq.token_ids)):
            self.finish(seq, "length")
        elif seq.extras is not None and seq.extras.grammar_too_slow:
            self.finish(seq, "grammar_too_slow")  # structured_output/matchers.py

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        if seq.num_pending_tokens:  # a surplus step may be in flight for it (async)
            drop_pending_tokens(seq)
        self.block_manager.deallocate(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:  # preempted while its last token was in flight, or aborted
            self.waiting.remove(seq)

    def abort(self, seq: Sequence) -> None:
        """Drop seq wherever it is (a fork not yet released is in no queue), its blocks
        released at once; a step already queued for it still runs, and postprocess drops its
        token."""
        if not seq.is_finished:
            self.finish(seq, "abort")
            # Its other completions (n > 1), if any, no longer wait for its prefill: each is
            # prefilled itself.
            release_forks(seq, self.waiting)
