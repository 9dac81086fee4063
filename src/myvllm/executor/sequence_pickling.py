"""What of a Sequence travels to the tensor-parallel workers each step, and how.

With tensor parallelism, rank 0 sends the batch's sequences to every worker each step
(pickled through a pipe). Workers only build input_ids/positions/slot_mapping; they never
sample, so they need neither the sampling params nor the status. What they need:

  prefill: seq_id, num_tokens, num_prompt_tokens, num_cached_tokens, block_table and ALL
           token_ids (the runner feeds token_ids[num_cached_tokens:]), and
           extras.needs_prompt_logprobs (the LM head over prompt rows is collective)
  decode:  the same counters and block_table, but only last_token (the one new token) and
           extras.spec_token_ids, the tokens proposed after it (speculative decoding), if any

Sending the whole token list every decode step would cost O(length) per sequence per step;
sending one int keeps a step's message small. "Prefill" means needs_prefill, not just "no
completion token yet": a sequence preempted after generating tokens is re-prefilled over
prompt + completion, and its workers need all of those tokens.

With async scheduling the last token may still be pending: its value is nowhere on the host
yet. The worker gets num_pending_tokens and sampled_row instead, and reads the token from its
own sampled-token pool, where rank 0 broadcast it (ModelRunner.run).

A worker-side copy is therefore partial: in a decode step it has no token_ids (reading them
raises AttributeError instead of returning wrong data), its sampling_params is None, and its
extras hold those two fields alone (None when neither is set).

The Executor registers this way of pickling a Sequence (register) with the pickler of
multiprocessing's connections, which carry its messages to the workers; the Sequence itself
knows nothing of it.
"""

from __future__ import annotations

from collections.abc import Callable
from multiprocessing.reduction import ForkingPickler
from typing import Any

from myvllm.engine.sequence import Sequence, SequenceStatus


def register() -> None:
    """Pickle every Sequence sent through a multiprocessing connection (the workers' pipes
    and sockets) as its worker copy (idempotent)."""
    ForkingPickler.register(Sequence, reduce_to_worker_copy)


def reduce_to_worker_copy(seq: Sequence) -> tuple[Callable[[tuple[Any, ...]], Sequence],
                                                   tuple[tuple[Any, ...]]]:
    """How a Sequence is pickled for a worker: worker_copy(worker_state(seq))."""
    return worker_copy, (worker_state(seq),)


def worker_copy(state: tuple[Any, ...]) -> Sequence:
    """A worker's copy of a Sequence, from worker_state: status RUNNING (it is in a step)."""
    seq = Sequence.__new__(Sequence)
    restore_worker_copy(seq, state)
    seq.status = SequenceStatus.RUNNING
    return seq


def worker_state(seq: Sequence) -> tuple[Any, ...]:
    """The partial copy a tensor-parallel worker needs (see above)."""
    tokens: list[int] | int | None = seq.token_ids if seq.needs_prefill else seq.last_token
    extras = seq.extras
    # Of the features' state only what the worker's forward reads (None when none is set).
    worker_extras = ((extras.needs_prompt_logprobs, extras.spec_token_ids)
                     if extras is not None
                     and (extras.needs_prompt_logprobs or extras.spec_token_ids) else None)
    return (seq.seq_id, seq.block_size, seq.num_tokens, seq.num_prompt_tokens,
            seq.num_cached_tokens, seq.num_computed_tokens, seq.num_new_tokens,
            seq.block_table, seq.needs_prefill, tokens, seq.num_pending_tokens,
            seq.sampled_row if seq.num_pending_tokens else None, worker_extras)


def restore_worker_copy(seq: Any, state: tuple[Any, ...]) -> None:
    """Fill a bare Sequence (seq) from worker_state (worker_copy sets its status)."""
    (seq.seq_id, seq.block_size, seq.num_tokens, seq.num_prompt_tokens,
     seq.num_cached_tokens, seq.num_computed_tokens, seq.num_new_tokens,
     seq.block_table, seq.needs_prefill, tokens, seq.num_pending_tokens,
     seq.sampled_row, worker_extras) = state
    seq.num_cached_prompt_tokens = None
    seq.finish_reason = None
    seq.sampling_params = None  # rank 0 samples
    seq.extras = None
    if worker_extras is not None:
        from myvllm.sample.extras import SequenceExtras

        seq.extras = SequenceExtras()
        seq.extras.needs_prompt_logprobs, seq.extras.spec_token_ids = worker_extras
    if seq.needs_prefill:
        seq.token_ids = tokens
        seq.last_token = tokens[-1] if tokens else -1
    else:
        seq.last_token = tokens
