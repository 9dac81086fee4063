"""Sequence: one request's tokens, its place in the queues, and its block table.

``block_table[i]`` is the physical block that holds tokens ``i*block_size ..
(i+1)*block_size - 1``; the BlockManager fills it and ``num_cached_tokens``, the ModelRunner
turns them into slot numbers (the guide's Step 3 draws the layout).
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import Enum, auto
from itertools import count
from typing import Literal

from myvllm.sampling_parameters import SamplingParams
from myvllm.value_checks import is_int, token_id_list

from myvllm.worker.pending_tokens import PendingTokens
from myvllm.sample.request_features import RequestFeatures
from myvllm.executor.sequence_pickling import restore_worker_copy, worker_state


# Why a sequence finished: eos or a stop token, max_tokens or max_model_length, or aborted by
# its caller.
FinishReason = Literal["stop", "length", "abort"]


class SequenceStatus(Enum):
    WAITING = auto()   # queued for a (re-)prefill; holds no blocks
    RUNNING = auto()   # holds blocks; gets one token per decode step
    FINISHED = auto()  # stopped (eos, a stop token, max_tokens, max_model_length); blocks freed


# The state of the features a first reading skips (sample/request_features.py), and async
# scheduling's tokens counted before they are known (worker/pending_tokens.py).
class Sequence(RequestFeatures, PendingTokens):
    # One counter for the process: seq_id is the request's id (EngineCore), orders the
    # outputs, and names the sequence in the steps sent to tensor-parallel workers.
    _ids = count()

    def __init__(self, token_ids: Iterable[int], block_size: int,
                 sampling_params: SamplingParams | None = None) -> None:
        if not (is_int(block_size) and block_size >= 1):
            raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
        tokens = token_id_list(token_ids)  # a copy: the caller may reuse its list
        self.seq_id: int = next(Sequence._ids)
        self.status: SequenceStatus = SequenceStatus.WAITING
        self.block_size: int = block_size
        self.token_ids: list[int] = tokens
        # -1 only for an empty prompt, which the scheduler refuses before it could run.
        self.last_token: int = tokens[-1] if tokens else -1
        self.num_tokens: int = len(tokens)
        self.num_prompt_tokens: int = len(tokens)
        # Leading tokens whose K/V came from the prefix cache at the last allocation (a
        # multiple of block_size); the runner computes only token_ids[num_cached_tokens:].
        self.num_cached_tokens: int = 0
        # Leading tokens whose K/V a step already scheduled writes, and the tokens the step
        # being scheduled computes (its chunk; 1 for a decode row).
        self.num_computed_tokens: int = 0
        self.num_new_tokens: int = 0
        # Speculative decoding: the tokens proposed after the last one for the step being
        # scheduled; never in token_ids (spec_decode/).
        self.spec_token_ids: list[int] = []
        self.block_table: list[int] = []
        # Chained prefix-cache hashes of the leading registered full blocks (BlockManager).
        self.block_hashes: list[int] = []
        self.sampling_params: SamplingParams = (sampling_params if sampling_params is not None
                                                else SamplingParams())
        # The next forward is a prefill (new, or after a preemption): a worker gets all tokens.
        self.needs_prefill: bool = True
        self.finish_reason: FinishReason | None = None
        RequestFeatures.__init__(self, self.seq_id, self.sampling_params)
        PendingTokens.__init__(self)

    # ------------------------------------------------------------------ token access
    def __len__(self) -> int:
        return self.num_tokens

    def append_token(self, token_id: int) -> None:
        """Record the next sampled token, in the oldest pending slot if there is one."""
        self.check_grammar_accepts(token_id)
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
    def last_block_num_tokens(self) -> int:
        """Tokens in the last block (1..block_size); the next token goes right after them."""
        return self.num_tokens - (self.num_blocks - 1) * self.block_size

    def block(self, i: int) -> list[int]:
        """Token ids of logical block i (the last one may be partial)."""
        if not 0 <= i < self.num_blocks:
            raise IndexError(f"block index {i} out of range for {self.num_blocks} blocks")
        return self.token_ids[i * self.block_size:(i + 1) * self.block_size]

    # Tensor parallelism: a worker gets a partial copy each step (sequence_pickling.py).
    __getstate__ = worker_state
    __setstate__ = restore_worker_copy

    def __repr__(self) -> str:
        return (f"Sequence(seq_id={self.seq_id}, status={self.status.name}, "
                f"num_tokens={self.num_tokens}, num_prompt_tokens={self.num_prompt_tokens}, "
                f"num_cached_tokens={self.num_cached_tokens}, block_table={self.block_table})")
