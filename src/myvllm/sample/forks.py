"""SamplingParams.n > 1: the other completions of a request, forked from its first.

The EngineCore makes them as it queues the first completion (make_forks), outside the
scheduler, as vLLM fans a request out. The first is prefilled as any prompt; the others wait
in its `extras.forks` until its last prompt chunk is scheduled, then join the front of
waiting with `extras.fork_source` naming it (release_forks).
At their first admission `fork` gives each the first's full prompt blocks (one
more reference each) and fresh blocks from the one holding the last prompt token, which
every completion recomputes in a block of its own, since each writes its own tokens after
it (the guide's Features, "n completions: forked after the prefill", draws it). After that
they are sequences like any other.
"""

from __future__ import annotations

from collections import deque

from typing import TYPE_CHECKING

from myvllm.engine.sequence import Sequence, SequenceStatus
from myvllm.sample.extras import extras_of

if TYPE_CHECKING:
    from myvllm.engine.block_manager import BlockManager


def make_forks(seq: Sequence) -> list[Sequence]:
    """Make seq's request's other completions, into seq.extras.forks, and return them. Each
    has the same prompt and its own sampling stream (SamplingParams.for_completion); the
    prompt's logprobs, if asked, are computed by seq alone and handed to them
    (take_prompt_logprobs). The EngineCore calls it as it queues seq (after
    Scheduler.add_sequence, before any step)."""
    extras = extras_of(seq)
    if extras.forks:
        return extras.forks  # made already
    for index in range(1, seq.sampling_params.n):
        fork = Sequence(seq.prompt_token_ids, seq.block_size,
                        seq.sampling_params.for_completion(index))
        fork.request_id, fork.index = seq.seq_id, index
        fork.streamed = seq.streamed
        fork_extras = extras_of(fork)
        fork_extras.fork_source = seq
        fork_extras.needs_prompt_logprobs, fork_extras.prompt_logprobs = False, None
        if extras.grammar_matcher is not None:  # its own matcher, at the grammar's start
            fork_extras.grammar_matcher = extras.grammar_matcher.fork()
        extras.forks.append(fork)
    return extras.forks


def fork_source(seq: Sequence) -> Sequence | None:
    """The first completion of seq's request, if seq is to be forked from it now: it still
    runs, and a step already scheduled writes the K/V of the blocks to share. Otherwise None,
    and seq is prefilled as any prompt (its source was preempted or aborted first)."""
    source = seq.extras.fork_source if seq.extras is not None else None
    if source is None or source.status != SequenceStatus.RUNNING:
        return None
    num_shared = num_shared_prompt_blocks(seq) * seq.block_size
    return source if source.num_computed_tokens >= num_shared else None


def can_fork(block_manager: BlockManager, seq: Sequence) -> bool:
    """Room for seq, another completion of a running prompt: fresh blocks past the shared?"""
    return len(block_manager.free_block_ids) >= seq.num_blocks - num_shared_prompt_blocks(seq)


def fork(block_manager: BlockManager, source: Sequence, seq: Sequence) -> None:
    """Give seq, another completion of source's prompt, source's shared prompt blocks and
    fresh blocks for the rest: a block is never written by two sequences, and no K/V is
    copied. The caller makes sure source's K/V of those blocks is written by a step already
    scheduled (the first completion's last prompt chunk)."""
    if seq.token_ids[:seq.num_prompt_tokens] != source.token_ids[:source.num_prompt_tokens]:
        raise ValueError(f"sequence {seq.seq_id} is no completion of sequence "
                         f"{source.seq_id}'s prompt")
    num_shared = num_shared_prompt_blocks(seq)
    if len(source.block_table) < num_shared:
        raise ValueError(f"sequence {source.seq_id} holds {len(source.block_table)} "
                         f"blocks, fewer than the {num_shared} to share")
    block_manager.allocate_blocks(seq, source.block_table[:num_shared])
    # The shared blocks are registered already (source's prompt chunks registered them);
    # register_full_blocks goes on after them for seq's own.
    seq.block_hashes = source.block_hashes[:num_shared]
    # Its shared prefix is no prefix-cache hit: it reports the first's.
    seq.num_cached_prompt_tokens = source.num_cached_prompt_tokens


def can_admit(block_manager: BlockManager, seq: Sequence) -> bool:
    """Room for seq, a request with extras: as a fork of its running first completion
    (fork_source), or else as any prompt."""
    return (can_fork(block_manager, seq) if fork_source(seq) is not None
            else block_manager.can_allocate(seq))


def admit(block_manager: BlockManager, seq: Sequence) -> None:
    """seq's blocks at its admission (can_admit first): forked from its first completion if
    it still may be, else allocated as any prompt's, no fresh block registered (the
    scheduler registers what the chunk writes). A fork at the first admission only."""
    source = fork_source(seq)
    if source is not None:
        fork(block_manager, source, seq)
    else:
        block_manager.allocate(seq, num_computable=0)
    assert seq.extras is not None
    seq.extras.fork_source = None


def release_forks(seq: Sequence, waiting: deque[Sequence]) -> None:
    """Queue seq's other completions at the front of waiting (in order), to be forked from
    it: its prompt's last chunk is scheduled, or it ended before."""
    if seq.extras is None:
        return
    for fork in reversed(seq.extras.forks):
        if not fork.is_finished:  # aborted meanwhile
            waiting.appendleft(fork)
    seq.extras.forks = []


def num_shared_prompt_blocks(seq: Sequence) -> int:
    """Full blocks of seq's prompt before the one holding its last token: what a fork
    shares."""
    return (seq.num_prompt_tokens - 1) // seq.block_size
