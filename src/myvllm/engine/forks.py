"""SamplingParams.n > 1: the other completions of a request, forked from its first.

The first completion is prefilled as any prompt; the others wait in its `forks` until its
last prompt chunk is scheduled, then join the front of waiting with `fork_source` naming it.
At their first admission BlockManager.fork gives each the first's full prompt blocks (one
more reference each) and fresh blocks from the one holding the last prompt token, which
every completion recomputes in a block of its own, since each writes its own tokens after
it (the guide's Step 3, "n completions", draws it). After that they are sequences like any
other.
"""

from __future__ import annotations

from collections import deque

from myvllm.engine.sequence import Sequence, SequenceStatus


def make_forks(seq: Sequence) -> None:
    """Make seq's request's other completions, into seq.forks. Each has the same prompt and
    its own sampling stream (SamplingParams.for_completion); the prompt's logprobs, if
    asked, are computed by seq alone and handed to them (take_prompt_logprobs)."""
    for index in range(1, seq.sampling_params.n):
        fork = Sequence(seq.prompt_token_ids, seq.block_size,
                        seq.sampling_params.for_completion(index))
        fork.request_id, fork.index, fork.fork_source = seq.seq_id, index, seq
        fork.streamed = seq.streamed
        fork.needs_prompt_logprobs, fork.prompt_logprobs = False, None
        if seq.grammar_matcher is not None:  # its own matcher, at the grammar's start
            fork.grammar_matcher = seq.grammar_matcher.fork()
        seq.forks.append(fork)


def fork_source(seq: Sequence) -> Sequence | None:
    """The first completion of seq's request, if seq is to be forked from it now: it still
    runs, and a step already scheduled writes the K/V of the blocks to share. Otherwise None,
    and seq is prefilled as any prompt (its source was preempted or aborted first)."""
    source = seq.fork_source
    if source is None or source.status != SequenceStatus.RUNNING:
        return None
    num_shared = num_shared_prompt_blocks(seq) * seq.block_size
    return source if source.num_computed_tokens >= num_shared else None


def release_forks(seq: Sequence, waiting: deque[Sequence]) -> None:
    """Queue seq's other completions at the front of waiting (in order), to be forked from
    it: its prompt's last chunk is scheduled, or it ended before."""
    for fork in reversed(seq.forks):
        if not fork.is_finished:  # aborted meanwhile
            waiting.appendleft(fork)
    seq.forks = []


def num_shared_prompt_blocks(seq: Sequence) -> int:
    """Full blocks of seq's prompt before the one holding its last token: what a fork
    shares."""
    return (seq.num_prompt_tokens - 1) // seq.block_size
