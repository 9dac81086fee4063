"""Sequence: one request's tokens, its place in the queues, and its block table.

``block_table[i]`` is the physical block that holds tokens ``i*block_size ..
(i+1)*block_size - 1``; the BlockManager fills it and ``num_cached_tokens``, the ModelRunner
turns them into slot numbers (the guide's Step 3 draws the layout).
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from enum import Enum, auto
from itertools import count
from typing import TYPE_CHECKING, Literal

from myvllm.sampling_parameters import SamplingParams
from myvllm.value_checks import refusal

if TYPE_CHECKING:
    from myvllm.sample.extras import SequenceExtras


# Why a sequence finished: eos or a stop token, max_tokens or max_model_length, or aborted by
# its caller.
# "grammar_too_slow": its grammar's matcher was the costliest of a step whose grammar work
# went over its limit (structured_output/step_budget.py).
FinishReason = Literal["stop", "length", "abort", "grammar_too_slow"]


class SequenceStatus(Enum):
    WAITING = auto()   # queued for a (re-)prefill; holds no blocks
    RUNNING = auto()   # holds blocks; gets one token per decode step
    FINISHED = auto()  # stopped (eos, a stop token, max_tokens, max_model_length); blocks freed


def asks_for_extras(params: SamplingParams) -> bool:
    """Does the request ask for an optional feature: n > 1, a seed, logprobs, a sampling
    control or penalty, a grammar? Then its Sequence gets extras, where the features keep
    their state, and `seq.extras is not None` is the core's one check before it calls a
    feature's code. (Temperature, top-k, top-p, max_tokens and ignore_eos are the plain
    path's own.)"""
    return (params.n > 1 or params.seed is not None or params.logprobs is not None
            or params.prompt_logprobs is not None or params.structured_outputs is not None
            or params.presence_penalty != 0 or params.frequency_penalty != 0
            or params.repetition_penalty != 1 or params.min_p != 0
            or params.logit_bias is not None or params.min_tokens != 0
            or params.stop_token_ids is not None)


def token_id_list(token_ids: Iterable[int]) -> list[int]:
    """A new list of the token ids, each an int >= 0 (a numpy integer becomes one): a
    Sequence's own check, for one made alone (the engine's requests were checked against the
    vocabulary before, engine/request_checks.py)."""
    # A copy: the caller may reuse or mutate its list. operator.index accepts numpy integers
    # but rejects floats and strings (plain ints skip it: prompts can be long).
    tokens = list(token_ids)
    if set(map(type, tokens)) - {int}:
        tokens = [operator.index(t) for t in tokens]
    if tokens and min(tokens) < 0:
        raise ValueError(f"token_ids[{tokens.index(min(tokens))}]={min(tokens)}: allowed: "
                         "token ids >= 0")
    return tokens


class Sequence:
    # One counter for the process: seq_id is the request's id (EngineCore), orders the
    # outputs, and names the sequence in the steps sent to tensor-parallel workers.
    _ids = count()

    def __init__(self, token_ids: Iterable[int], block_size: int,
                 sampling_params: SamplingParams | None = None) -> None:
        # An int, not a bool (True as a block size is a bug, not a 1).
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise refusal("Sequence.block_size", block_size, "an int >= 1")
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
        self.block_table: list[int] = []
        # Chained prefix-cache hashes of the leading registered full blocks (BlockManager).
        self.block_hashes: list[int] = []
        self.sampling_params: SamplingParams = (sampling_params if sampling_params is not None
                                                else SamplingParams())
        # The next forward is a prefill (new, or after a preemption): a worker gets all tokens.
        self.needs_prefill: bool = True
        self.finish_reason: FinishReason | None = None
        # Someone reads its tokens as they come: then the steps it decodes in stay short
        # (Config.max_prefill_tokens_while_decoding); generate() reads them at the end.
        self.streamed: bool = True
        # The request this sequence is a completion of (its first completion's seq_id), and
        # which completion it is (SamplingParams.n > 1: sample/forks.py).
        self.request_id: int = self.seq_id
        self.index: int = 0
        # num_cached_tokens at the first admission: a re-prefill's hits on its own freed
        # blocks are no prompt hits.
        self.num_cached_prompt_tokens: int | None = None
        # Recompute preemptions so far: a draft model's K/V of the sequence is then gone
        # (spec_decode/draft_proposer.py).
        self.num_preemptions: int = 0
        # Async scheduling (the guide's Features): tokens counted in num_tokens, not yet in
        # token_ids (their values are still on the device; worker/pending_tokens.py counts
        # and drops them), and the row of the last one in the last step's sampled-token pool
        # (worker/token_pool.py).
        self.num_pending_tokens: int = 0
        self.sampled_row: int | None = None
        # The optional features' state (sample/extras.py): None for a plain request.
        self.extras: SequenceExtras[Sequence] | None = None
        if asks_for_extras(self.sampling_params):
            from myvllm.sample.extras import SequenceExtras
            self.extras = SequenceExtras(self.sampling_params.prompt_logprobs is not None)

    # ------------------------------------------------------------------ token access
    def __len__(self) -> int:
        return self.num_tokens

    def append_token(self, token_id: int) -> None:
        """Record the next sampled token, in the oldest pending slot if there is one."""
        if self.extras is not None and self.extras.grammar_matcher is not None:
            self.extras.advance_grammar(self.seq_id, token_id)
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
        if self.extras is not None:
            self.extras.spec_token_ids = []
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

    def __repr__(self) -> str:
        return (f"Sequence(seq_id={self.seq_id}, status={self.status.name}, "
                f"num_tokens={self.num_tokens}, num_prompt_tokens={self.num_prompt_tokens}, "
                f"num_cached_tokens={self.num_cached_tokens}, block_table={self.block_table})")
