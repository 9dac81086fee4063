"""async_scheduling's steps that EngineCore.step queued and has not read back yet
(engine/core.py): a step's pending tokens and the step kept in flight (the guide's Step 6,
"Async scheduling"); and the undo of a step that failed before it ran (any step).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

from myvllm.engine.batch import RequestOutput
from myvllm.engine.sequence import Sequence
from myvllm.worker.staging import SampledTokens

if TYPE_CHECKING:
    from myvllm.engine.scheduler import Scheduler
    from myvllm.spec_decode.scheduling import Speculator


@dataclasses.dataclass
class QueuedStep:
    """A step whose tokens are on their way (the runner returned, nobody waited)."""

    seqs: list[Sequence]
    num_tokens: int  # what step() reports: > 0 prompt tokens computed, < 0 decode
    sampled: SampledTokens  # rank 0's run() result
    samples: list[bool]  # which of seqs get their token (not a chunk short of its prompt's end)
    constrained: bool = False  # the next step must wait for these tokens on the host


def queued_step(seqs: list[Sequence], num_tokens: int, sampled: SampledTokens,
                samples: list[bool], speculator: Speculator | None) -> QueuedStep:
    """A step the runner has queued: each sequence that samples in it counts its token as
    pending until the step is read back."""
    constrained = False
    for seq, sample in zip(seqs, samples, strict=True):
        if sample:
            seq.add_pending_token()
            constrained = (constrained or (
                seq.extras is not None and seq.extras.grammar_matcher is not None) or (
                speculator is not None and speculator.needs_tokens_on_host(seq)))
    return QueuedStep(seqs, num_tokens, sampled, samples, constrained)


class InFlight:
    """async_scheduling: the step queued by the previous EngineCore.step call, not read yet
    (the core has none without async scheduling)."""

    def __init__(self) -> None:
        self.step: QueuedStep | None = None

    def step_through(
            self, schedule: Callable[[], tuple[list[Sequence], bool]],
            queue: Callable[[list[Sequence], bool], QueuedStep],
            read_back: Callable[[QueuedStep], tuple[list[RequestOutput], int]],
    ) -> tuple[list[RequestOutput], int]:
        """One EngineCore.step: schedule and queue the next step, then read back the one
        queued by the previous call, unless that one must be on the host before the next is
        planned (a grammar's next bitmask, speculation's accepted tokens): then it is read
        back first and nothing new is queued."""
        constrained = self.take_constrained()
        waited = read_back(constrained) if constrained is not None else None
        seqs, is_prefill = schedule()
        queued = self.swap(queue(seqs, is_prefill) if seqs else None)  # the one before
        if waited is not None:  # the step read back above (the one before is in flight)
            assert queued is None
            return waited
        if queued is None:  # nothing queued (or the first step of a run, still in flight)
            return [], 0
        return read_back(queued)

    def take_constrained(self) -> QueuedStep | None:
        """The step in flight, taken out, if the next schedule needs its tokens on the host
        (a grammar's next bitmask, speculation's accepted tokens); else None."""
        step = self.step
        if step is None or not step.constrained:
            return None
        self.step = None
        return step

    def swap(self, queued: QueuedStep | None) -> QueuedStep | None:
        """The step to read back now: the one in flight (queued takes its place)."""
        earlier, self.step = self.step, queued
        return earlier

    def drop(self) -> None:
        """Forget the step in flight (after an error or Ctrl-C): its sequences forget their
        pending token, which the next step recomputes (the device runs steps in order)."""
        if self.step is not None:
            for seq in self.step.seqs:
                seq.drop_pending_tokens()
            self.step = None


def undo_step(scheduler: Scheduler, seqs: list[Sequence]) -> None:
    """A step failed before it ran (Ctrl-C, out of memory): none of its K/V was written.
    The blocks it was to fill (registered for prefix hits when it was scheduled) are
    unregistered, and its sequences go back to waiting, to be recomputed (one admitted in
    this step may hold a hit on a block that another row of this step was to write)."""
    block_manager = scheduler.block_manager
    for seq in seqs:
        seq.num_computed_tokens -= seq.num_new_tokens
        block_manager.unregister_after(seq, seq.num_computed_tokens)
    for seq in seqs:
        if not seq.is_finished:
            scheduler.preempt(seq)
