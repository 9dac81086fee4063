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
from myvllm.value_checks import refusal

if TYPE_CHECKING:
    from myvllm.engine.scheduler_view import SchedulerView


def check_token_ids(prompt: Any, vocab_size: int) -> list[int]:
    """A prompt of token ids as a list of ints, or a clear error (before anything is queued)."""
    if not isinstance(prompt, SequenceABC) or isinstance(prompt, (str, bytes, bytearray)):
        # bytes are a sequence of ints too, but they are text, not token ids.
        raise refusal("prompt", prompt, "a str or a list of int token ids", TypeError)
    token_ids = list(prompt)
    # Plain ints pass with one C-level check. A Python-level isinstance() per token took
    # 13-25 ms for a 16k-token prompt on a 2-core machine: host time between two steps,
    # which every decoding stream waited for.
    if set(map(type, token_ids)) - {int}:
        bad_types = [(i, t) for i, t in enumerate(token_ids)
                     if not isinstance(t, numbers.Integral) or isinstance(t, bool)]
        if bad_types:
            raise refusal(f"token_ids[{bad_types[0][0]}]", bad_types[0][1],
                          "an int token id (a Python or numpy int, not a bool)", TypeError)
        token_ids = [int(t) for t in token_ids]  # numpy ints are fine, stored as int
    if token_ids and not (0 <= min(token_ids) and max(token_ids) < vocab_size):
        i, bad = next((i, t) for i, t in enumerate(token_ids) if not 0 <= t < vocab_size)
        raise refusal(f"token_ids[{i}]", bad, f"a token id of the vocabulary, [0, {vocab_size})")
    return token_ids


def check_request(token_ids: Any, params: Any, vocab_size: int) -> list[int]:
    """A prompt of token ids and its SamplingParams checked: the prompt as a list of ints."""
    if not isinstance(params, SamplingParams):
        raise refusal("sampling_params", params, "a SamplingParams", TypeError)
    if params.logit_bias is not None or params.stop_token_ids is not None:
        check_sampling_token_ids(params, vocab_size)  # sample/sampling_controls.py
    return check_token_ids(token_ids, vocab_size)


def check_generate_args(prompts: Any, sampling_params: Any) -> list[SamplingParams]:
    """generate()'s arguments checked: prompts a list, sampling_params None (the defaults),
    one SamplingParams for all or one per prompt. Returns one per prompt."""
    if not isinstance(prompts, (list, tuple)):
        raise refusal("prompts", prompts, "a list of prompts, each a str or a list of int "
                      "token ids", TypeError)
    if sampling_params is None:
        sampling_params = SamplingParams()
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * len(prompts)
    if not isinstance(sampling_params, (list, tuple)):
        # A dict would otherwise be iterated as its keys and reported as a str.
        raise refusal("sampling_params", sampling_params, "None (the defaults), a "
                      "SamplingParams, or a list of them (one per prompt)", TypeError)
    if len(sampling_params) != len(prompts):
        raise refusal("len(sampling_params)", len(sampling_params),
                      f"{len(prompts)}, one per prompt (or one SamplingParams for all)")
    return list(sampling_params)


def check_prompt_length(num_prompt_tokens: int, max_model_length: int) -> None:
    """The prompt and at least one completion token must fit (vLLM's rule): a prompt of
    max_model_length tokens would have its first token past the limit."""
    if num_prompt_tokens >= max_model_length:
        raise refusal("prompt_tokens", num_prompt_tokens,
                      f"at most {max_model_length - 1} with max_model_length={max_model_length}"
                      " (the prompt and at least one completion token must fit)")


def check_max_tokens(num_prompt_tokens: int, max_tokens: int, max_model_length: int) -> None:
    """The prompt and max_tokens must fit in max_model_length (vLLM's server rule: a request
    is never cut short by the context without having been told). One check, one message for
    the library (LLM, AsyncLLM, the engine core) and the server's 400."""
    if num_prompt_tokens + max_tokens > max_model_length:
        raise refusal("max_tokens", max_tokens,
                      f"at most {max_model_length - num_prompt_tokens} beside a prompt of "
                      f"{num_prompt_tokens} tokens (prompt + max_tokens <= max_model_length="
                      f"{max_model_length}), or a shorter prompt")


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
        raise ValueError(f"sequence {seq.seq_id} is not a new request (status "
                         f"{seq.status.name}, {len(seq.block_table)} blocks, "
                         f"{seq.num_completion_tokens} completion tokens): allowed: a WAITING "
                         "sequence with no blocks and no completion tokens")
    if seq.block_size != scheduler.block_size:
        raise refusal(f"sequence {seq.seq_id}: block_size", seq.block_size,
                      f"{scheduler.block_size}, the KV cache's block size")
    if seq.num_prompt_tokens == 0:
        raise refusal("prompt_tokens", 0, "at least 1 (an empty prompt has no token to "
                      "start from)")
    check_prompt_length(seq.num_prompt_tokens, scheduler.max_model_length)
    need_tokens = max_kv_tokens(seq, scheduler.max_model_length)
    need_blocks = (need_tokens + scheduler.block_size - 1) // scheduler.block_size
    total_blocks = len(scheduler.block_manager.blocks)
    if need_blocks > total_blocks:
        raise ValueError(
            f"sequence {seq.seq_id} can grow to {need_tokens} tokens = {need_blocks} blocks "
            f"of {scheduler.block_size}: allowed: at most the {total_blocks} blocks of the "
            "whole KV cache (shorten the prompt or max_tokens, or give the cache more blocks)")
    if need_tokens > scheduler.max_num_batched_tokens and not scheduler.enable_chunked_prefill:
        raise ValueError(
            f"sequence {seq.seq_id} can grow to {need_tokens} tokens: allowed: at most "
            f"max_num_batched_tokens={scheduler.max_num_batched_tokens} without chunked "
            "prefill (after a preemption it is prefilled whole, in one step, or never "
            "again); raise max_num_batched_tokens or shorten it")


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
