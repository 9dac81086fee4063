"""Sequence: one request's tokens, its place in the queues, and its block table.

A sequence is the prompt followed by the tokens generated so far. Its K/V lives in the
paged cache in blocks of ``block_size`` tokens; ``block_table[i]`` is the physical block that
holds tokens ``i*block_size .. (i+1)*block_size - 1``:

    block_size = 4, 10 tokens          t0 t1 t2 t3 | t4 t5 t6 t7 | t8 t9 .  .
    block_table = [7, 2, 9]              block 7       block 2       block 9 (2 of 4 used)
    num_blocks = ceil(10 / 4) = 3,  last_block_num_tokens = 2

The Sequence only *describes* that layout; the BlockManager fills ``block_table`` and
``num_cached_tokens`` and the ModelRunner turns them into slot numbers.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from enum import Enum, auto
from itertools import count
from typing import TYPE_CHECKING, Any, Literal

from myvllm.sampling_parameters import SamplingParams
from myvllm.value_checks import is_int

from myvllm.engine.core_messages import LogprobsLists
from myvllm.engine.sequence_pickling import restore_worker_copy, worker_state

if TYPE_CHECKING:
    import torch


# Why a sequence finished: eos or a stop token, max_tokens or max_model_length, or aborted by
# its caller.
FinishReason = Literal["stop", "length", "abort"]


class SequenceStatus(Enum):
    WAITING = auto()   # queued for a (re-)prefill; holds no blocks
    RUNNING = auto()   # holds blocks; gets one token per decode step
    FINISHED = auto()  # stopped (eos, a stop token, max_tokens, max_model_length); blocks freed


class Sequence:
    # One counter for the process: seq_id is the request's id (EngineCore), orders the
    # outputs, and names the sequence in the steps sent to tensor-parallel workers.
    _ids = count()

    def __init__(self, token_ids: Iterable[int], block_size: int,
                 sampling_params: SamplingParams | None = None) -> None:
        if not (is_int(block_size) and block_size >= 1):
            raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
        # A copy: the caller may reuse or mutate its list; our tokens must not change under us.
        # operator.index accepts ints and numpy integers but rejects floats and strings (plain
        # ints skip the per-token call: a prompt can be 40k tokens long).
        tokens = list(token_ids)
        if set(map(type, tokens)) - {int}:
            tokens = [operator.index(t) for t in tokens]
        if tokens and min(tokens) < 0:
            raise ValueError(f"token ids must be >= 0, got {min(tokens)}")
        self.seq_id: int = next(Sequence._ids)
        self.status: SequenceStatus = SequenceStatus.WAITING
        self.block_size: int = block_size
        self.token_ids: list[int] = tokens
        # -1 only for an empty prompt, which the scheduler refuses before it could run.
        self.last_token: int = tokens[-1] if tokens else -1
        self.num_tokens: int = len(tokens)
        self.num_prompt_tokens: int = len(tokens)
        # Leading tokens whose K/V came from the prefix cache at the last allocation; always a
        # multiple of block_size. The runner computes only token_ids[num_cached_tokens:].
        # 0 while waiting (again) after a preemption; kept after the sequence finishes.
        self.num_cached_tokens: int = 0
        # Chunked prefill: leading tokens whose K/V is written by a step already scheduled
        # (num_cached_tokens at admission, then advanced chunk by chunk), and the tokens the
        # step being scheduled computes for this sequence (its chunk; 1 for a decode row).
        self.num_computed_tokens: int = 0
        self.num_new_tokens: int = 0
        # Speculative decoding: the tokens proposed after the last one for the step being
        # scheduled (its row computes the last token and these: num_new_tokens = 1 + len).
        # Never in token_ids: only the accepted ones are appended (engine/spec_decode/).
        self.spec_token_ids: list[int] = []
        # Recompute preemptions so far: a draft model's K/V of the sequence is then gone
        # (engine/spec_decode/draft_proposer.py).
        self.num_preemptions: int = 0
        self.block_table: list[int] = []
        # Chained prefix-cache hashes of the leading full blocks, memoised by the BlockManager
        # (a full block's tokens never change, so neither does its hash). Rank 0 only: not
        # shipped to tensor-parallel workers.
        self.block_hashes: list[int] = []
        self.sampling_params: SamplingParams = (sampling_params if sampling_params is not None
                                                else SamplingParams())
        # SamplingParams.prompt_logprobs still to compute: the prefill's LM head runs over its
        # prompt rows too (on every rank), and it reads no prefix-cache hit (a cached token
        # has no logits). Cleared once all of them reached the host.
        self.needs_prompt_logprobs: bool = self.sampling_params.prompt_logprobs is not None
        # The next forward is a prefill (new, or after a preemption): a worker gets all tokens.
        self.needs_prefill: bool = True
        # Counted in num_tokens, not yet in token_ids (add_pending_token); a count because a
        # worker's copy has no token_ids.
        self.num_pending_tokens: int = 0
        # Rank 0's per-request state, which ends with the request: num_cached_tokens at the
        # first admission (a re-prefill's hits on its own freed blocks are no prompt hits);
        # the prompt logprobs read back so far, until an output carries them away; the seeded
        # generator (made at the first sampled step); the prompt's distinct ids for
        # repetition_penalty (engine/sampling_controls.py); the grammar's matcher
        # (engine/structured_output.py); the row of its token in the last step's sampled-token
        # pool (engine/token_pool.py); why it finished; and whether someone reads its tokens
        # as they come (then the steps it decodes in stay short; generate() reads them at
        # the end: Config.max_prefill_tokens_while_decoding).
        self.num_cached_prompt_tokens: int | None = None
        self.prompt_logprobs: LogprobsLists | None = (
            LogprobsLists([], [], []) if self.needs_prompt_logprobs else None)
        self.generator: torch.Generator | None = None
        self.penalty_prompt_ids: torch.Tensor | None = None
        self.grammar_matcher: Any = None
        self.sampled_row: int | None = None
        self.finish_reason: FinishReason | None = None
        self.streamed: bool = True
        # SamplingParams.n > 1 (engine/forks.py): the request this sequence is one completion
        # of (its first completion's seq_id), which completion it is, the others (held by the
        # first until its prefill's last chunk is scheduled) and, for those, the first.
        self.request_id: int = self.seq_id
        self.index: int = 0
        self.forks: list[Sequence] = []
        self.fork_source: Sequence | None = None

    # ------------------------------------------------------------------ token access
    def __len__(self) -> int:
        return self.num_tokens

    def __getitem__(self, key: int | slice) -> Any:
        return self.token_ids[key]

    def append_token(self, token_id: int) -> None:
        """Record the next sampled token.

        If a slot was reserved for it (add_pending_token), the token fills the oldest
        reserved slot; otherwise the sequence grows by one.
        """
        if self.grammar_matcher is not None and not self.grammar_matcher.accept_token(token_id):
            # The sampler only picks tokens the matcher's bitmask allowed, so this is a bug.
            raise RuntimeError(f"sequence {self.seq_id}: token {token_id} was sampled but its "
                               "grammar does not accept it")
        self.token_ids.append(token_id)
        self.last_token = token_id
        if self.num_pending_tokens:
            self.num_pending_tokens -= 1
        else:
            self.num_tokens += 1
        # Preempted while this token was pending: the next forward still recomputes all.
        self.needs_prefill = self.status == SequenceStatus.WAITING

    def reset_for_recompute(self) -> None:
        """Preempted: back to waiting, nothing of it in the cache, the next forward a prefill
        over prompt + completion so far (its blocks are freed by the BlockManager)."""
        self.status = SequenceStatus.WAITING
        self.num_cached_tokens = 0
        self.num_computed_tokens = 0
        self.spec_token_ids = []
        self.num_preemptions += 1
        self.needs_prefill = True

    # A pending token has been sampled on the device but not yet read by the host. With
    # overlapped ("async") scheduling the engine plans step N+1 before step N's tokens reach
    # the host, so each sequence of step N counts one token it cannot see yet:
    #
    #     token_ids  = [t0 t1 t2 t3 t4]      what the host knows
    #     num_tokens = 6                     + 1 pending: its K/V slot, its place in a block
    #
    # The scheduler and the BlockManager plan with num_tokens (lengths are all they need);
    # the runner feeds a pending token from the device; postprocess fills it in.
    def add_pending_token(self) -> None:
        self.num_tokens += 1
        self.num_pending_tokens += 1

    def drop_pending_tokens(self) -> None:
        """Forget tokens that will never be read (the sequence finished, or its step was
        abandoned); the next step recomputes from the last known token."""
        if self.num_pending_tokens:
            self.num_tokens -= self.num_pending_tokens
            self.num_pending_tokens = 0
            # The last known token's K/V came from the abandoned step: compute it again.
            self.num_computed_tokens = min(self.num_computed_tokens, self.num_tokens - 1)

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def num_completion_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    # ------------------------------------------------------------------ block layout
    @property
    def num_blocks(self) -> int:
        """Blocks needed to hold num_tokens tokens: ceil(num_tokens / block_size)."""
        return (self.num_tokens + self.block_size - 1) // self.block_size

    @property
    def num_cached_blocks(self) -> int:
        return self.num_cached_tokens // self.block_size

    @property
    def last_block_num_tokens(self) -> int:
        """Tokens in the last block (1..block_size); the next token goes right after them."""
        return self.num_tokens - (self.num_blocks - 1) * self.block_size

    def block(self, i: int) -> list[int]:
        """Token ids of logical block i (the last one may be partial, or short by the
        pending tokens)."""
        if not 0 <= i < self.num_blocks:
            raise IndexError(f"block index {i} out of range for {self.num_blocks} blocks")
        return self.token_ids[i * self.block_size:(i + 1) * self.block_size]

    # Tensor parallelism: what a worker gets of the sequence each step, a partial copy
    # (sequence_pickling.py says what and why).
    def __getstate__(self) -> tuple[Any, ...]:
        return worker_state(self)

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        restore_worker_copy(self, state)

    def __repr__(self) -> str:
        return (f"Sequence(seq_id={self.seq_id}, status={self.status.name}, "
                f"num_tokens={self.num_tokens}, num_prompt_tokens={self.num_prompt_tokens}, "
                f"num_cached_tokens={self.num_cached_tokens}, block_table={self.block_table})")
