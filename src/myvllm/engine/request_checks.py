"""Checks of a request before anything is queued: bad input raises a clear error here.

EngineCore.make_sequence runs them on every prompt (AsyncLLM and the server too, before they
send it to the engine core); Scheduler.check_sequence refuses a sequence that could never run.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence as SequenceABC
from typing import TYPE_CHECKING, Any

from myvllm.engine.sequence import Sequence, SequenceStatus
from myvllm.sample.sampling_controls import check_sampling_token_ids
from myvllm.sampling_parameters import SamplingParams

if TYPE_CHECKING:
    from myvllm.engine.scheduler_view import SchedulerView


def check_token_ids(prompt: Any, vocab_size: int) -> list[int]:
    """A prompt of token ids as a list of ints, or a clear error (before anything is queued)."""
    if not isinstance(prompt, SequenceABC) or isinstance(prompt, (str, bytes, bytearray)):
        # bytes are a sequence of ints too, but they are text, not token ids.
        raise TypeError("a prompt must be a str or a list of int token ids, got "
                        f"{type(prompt).__name__}")
    token_ids = list(prompt)
    # Plain ints pass with one C-level check. A Python-level isinstance() per token took
    # 13-25 ms for a 16k-token prompt on a 2-core machine: host time between two steps,
    # which every decoding stream waited for.
    if set(map(type, token_ids)) - {int}:
        bad_types = [t for t in token_ids
                     if not isinstance(t, numbers.Integral) or isinstance(t, bool)]
        if bad_types:
            raise TypeError(f"token ids must be ints, got {bad_types[0]!r} "
                            f"({type(bad_types[0]).__name__}) in a prompt")
        token_ids = [int(t) for t in token_ids]  # numpy ints are fine, stored as int
    if token_ids and not (0 <= min(token_ids) and max(token_ids) < vocab_size):
        bad = next(t for t in token_ids if not 0 <= t < vocab_size)
        raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab_size}).")
    return token_ids


def check_request(token_ids: Any, params: Any, vocab_size: int) -> list[int]:
    """A prompt of token ids and its SamplingParams checked: the prompt as a list of ints."""
    if not isinstance(params, SamplingParams):
        raise TypeError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
    if params.logit_bias is not None or params.stop_token_ids is not None:
        check_sampling_token_ids(params, vocab_size)  # sample/sampling_controls.py
    return check_token_ids(token_ids, vocab_size)


def check_generate_args(prompts: Any, sampling_params: Any) -> list[SamplingParams]:
    """generate()'s arguments checked: prompts a list, sampling_params None (the defaults),
    one SamplingParams for all or one per prompt. Returns one per prompt."""
    if not isinstance(prompts, (list, tuple)):
        raise TypeError("prompts must be a list of strings or token-id lists, got "
                        f"{type(prompts).__name__}")
    if sampling_params is None:
        sampling_params = SamplingParams()
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * len(prompts)
    if not isinstance(sampling_params, (list, tuple)):
        # A dict would otherwise be iterated as its keys and reported as a str.
        raise TypeError("sampling_params must be a SamplingParams or a list of them, got "
                        f"{type(sampling_params).__name__}")
    if len(sampling_params) != len(prompts):
        raise ValueError(f"got {len(sampling_params)} sampling_params for "
                         f"{len(prompts)} prompts; pass one, or one per prompt.")
    return list(sampling_params)


def check_prompt_length(num_prompt_tokens: int, max_model_length: int) -> None:
    """The prompt and at least one completion token must fit (vLLM's rule): a prompt of
    max_model_length tokens would have its first token past the limit."""
    if num_prompt_tokens >= max_model_length:
        what = "longer than" if num_prompt_tokens > max_model_length else "as long as"
        raise ValueError(f"prompt of {num_prompt_tokens} tokens is {what} max_model_length="
                         f"{max_model_length}; the prompt and at least one completion token "
                         "must fit")


def check_max_tokens(num_prompt_tokens: int, max_tokens: int, max_model_length: int) -> None:
    """The prompt and max_tokens must fit in max_model_length (vLLM's server rule: a request
    is never cut short by the context without having been told). One check, one message for
    the library (LLM, AsyncLLM, the engine core) and the server's 400."""
    if num_prompt_tokens + max_tokens > max_model_length:
        raise ValueError(f"prompt of {num_prompt_tokens} tokens + max_tokens={max_tokens} is "
                         f"{num_prompt_tokens + max_tokens} tokens, more than max_model_length="
                         f"{max_model_length}: ask for at most "
                         f"{max_model_length - num_prompt_tokens} completion tokens, or "
                         "shorten the prompt")


def check_fits_context(num_prompt_tokens: int, max_tokens: int, max_model_length: int) -> None:
    """check_prompt_length, then check_max_tokens: what a request's lengths must satisfy."""
    check_prompt_length(num_prompt_tokens, max_model_length)
    check_max_tokens(num_prompt_tokens, max_tokens, max_model_length)


def max_kv_tokens(seq: Sequence, max_model_length: int) -> int:
    """Most tokens seq can ever need in the KV cache (and in one prefill).

    A sequence is only scheduled while unfinished, i.e. with fewer than max_tokens
    completion tokens and fewer than max_model_length tokens. The token sampled by its
    last step is never written to the cache. So it needs room for its prompt, and for at
    most min(prompt + max_tokens, max_model_length) - 1 tokens once it decodes (a
    re-prefill after preemption covers the same tokens).
    """
    longest = min(seq.num_prompt_tokens + seq.sampling_params.max_tokens, max_model_length)
    return max(seq.num_prompt_tokens, longest - 1)


def check_schedulable(seq: Sequence, scheduler: SchedulerView) -> None:
    """Raise ValueError if seq could never run on this scheduler: not a new request, another
    block size, an empty prompt, no room for one completion token, more blocks than the whole
    cache, or (prefill first) a re-prefill after preemption larger than a step."""
    if seq.status != SequenceStatus.WAITING or seq.block_table or seq.num_completion_tokens:
        raise ValueError(f"sequence {seq.seq_id} is not a new request "
                         f"(status {seq.status.name}, {len(seq.block_table)} blocks, "
                         f"{seq.num_completion_tokens} completion tokens)")
    if seq.block_size != scheduler.block_size:
        raise ValueError(f"sequence {seq.seq_id} was built with block_size "
                         f"{seq.block_size}, the KV cache uses {scheduler.block_size}")
    if seq.num_prompt_tokens == 0:
        raise ValueError("empty prompt: a prompt needs at least one token")
    check_prompt_length(seq.num_prompt_tokens, scheduler.max_model_length)
    need_tokens = max_kv_tokens(seq, scheduler.max_model_length)
    need_blocks = (need_tokens + scheduler.block_size - 1) // scheduler.block_size
    total_blocks = len(scheduler.block_manager.blocks)
    if need_blocks > total_blocks:
        raise ValueError(
            f"sequence {seq.seq_id} can grow to {need_tokens} tokens = {need_blocks} blocks "
            f"of {scheduler.block_size}, but the whole KV cache has {total_blocks} blocks; "
            "shorten the prompt or max_tokens, or give the cache more blocks")
    if need_tokens > scheduler.max_num_batched_tokens and not scheduler.enable_chunked_prefill:
        raise ValueError(
            f"sequence {seq.seq_id} can grow to {need_tokens} tokens, more than "
            f"max_num_batched_tokens={scheduler.max_num_batched_tokens}: after a preemption it "
            "could never be prefilled again; raise max_num_batched_tokens or shorten it")


def no_progress_error(scheduler: SchedulerView) -> RuntimeError:
    """What Scheduler.schedule raises when a step schedules and preempts nothing while work
    remains (every later step would do the same)."""
    bm = scheduler.block_manager
    return RuntimeError(
        f"Scheduler made no progress: {len(scheduler.waiting)} waiting and "
        f"{len(scheduler.running)} running sequences, {len(bm.free_block_ids)} of "
        f"{len(bm.blocks)} blocks free. Either a sequence cannot fit in the KV cache "
        "(add_sequence should have rejected it), or blocks leaked because their "
        "ref_count never returned to 0.")
