"""A step the runner has queued and nobody has waited for yet (QueuedStep, any step); with
async_scheduling, the one EngineCore.step keeps in flight and its pending tokens (the guide's
Features, "Async scheduling"); the undo of a step that failed before it ran (any step); and
what a step's features hand back beside its tokens (read_features: logprobs, verified tokens).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from myvllm.engine.batch import RequestOutput
from myvllm.engine.sequence import Sequence
from myvllm.sample.extras import LogprobsLists
from myvllm.sample.logprobs import read_step_logprobs
from myvllm.spec_decode.verification import verified_token_lists
from myvllm.worker.pending_tokens import add_pending_token, drop_pending_tokens
from myvllm.worker.staging import SampledTokens

if TYPE_CHECKING:
    from myvllm.engine.block_manager import BlockManager
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


def read_features(step: QueuedStep, sampling: list[int]
                  ) -> tuple[list[LogprobsLists | None] | None, dict[int, list[int]] | None]:
    """A read-back step's logprobs, one entry per index of sampling (the rows that sampled:
    sample/logprobs.py), and speculative decoding's tokens of its verification rows
    (spec_decode/verification.py); each None when no row has them."""
    logprobs = (None if step.sampled.logprobs is None
                else read_step_logprobs(step.seqs, step.sampled.logprobs, sampling))
    verified = (None if step.sampled.verified is None
                else verified_token_lists(step.sampled.verified, sampling))
    return logprobs, verified


class CoreSteps(Protocol):
    """What InFlight drives of the EngineCore (engine/core.py, which imports this module)."""

    @property
    def scheduler(self) -> Scheduler: ...

    def run_step(self, seqs: list[Sequence], is_prefill: bool) -> QueuedStep: ...

    def read_back(self, step: QueuedStep) -> list[RequestOutput]: ...


def left_in_flight(step: QueuedStep, speculator: Speculator | None) -> QueuedStep:
    """A step that stays in flight: each sequence that samples in it counts its token as
    pending until the step is read back."""
    for seq, sample in zip(step.seqs, step.samples, strict=True):
        if sample:
            add_pending_token(seq)
            step.constrained = (step.constrained or (
                seq.extras is not None and seq.extras.grammar_matcher is not None) or (
                speculator is not None and speculator.needs_tokens_on_host(seq)))
    return step


class InFlight:
    """async_scheduling: the step queued by the previous EngineCore.step call, not read yet
    (the core has none without async scheduling)."""

    def __init__(self) -> None:
        self.step: QueuedStep | None = None

    def step_through(self, core: CoreSteps) -> tuple[list[RequestOutput], int]:
        """One EngineCore.step: schedule and queue the next step, then read back the one
        queued by the previous call, unless that one must be on the host before the next is
        planned (a grammar's next bitmask, speculation's accepted tokens): then it is read
        back first and nothing new is queued."""
        constrained = self.take_constrained()
        waited = None
        if constrained is not None:
            waited = core.read_back(constrained), constrained.num_tokens
        seqs, is_prefill = core.scheduler.schedule()
        queued = self.swap(left_in_flight(core.run_step(seqs, is_prefill),
                                          core.scheduler.speculator)
                           if seqs else None)  # the one before
        if waited is not None:  # the step read back above (the one before is in flight)
            assert queued is None
            return waited
        if queued is None:  # nothing queued (or the first step of a run, still in flight)
            return [], 0
        return core.read_back(queued), queued.num_tokens

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
                drop_pending_tokens(seq)
            self.step = None


class StopsWorkers(Protocol):
    """The Executor (executor/executor.py) of the tensor-parallel workers, as an abandoned run
    stops it."""

    def stop_workers_now(self) -> None: ...


class AbandonedCore(Protocol):
    """What of the EngineCore (engine/core.py) a run given up mid-way reads."""

    @property
    def in_flight(self) -> InFlight | None: ...

    @property
    def workers(self) -> StopsWorkers | None: ...


def drop_in_flight(core: AbandonedCore) -> None:
    """Forget the step in flight (after an error or Ctrl-C; InFlight.drop); none without
    async scheduling."""
    if core.in_flight is not None:
        core.in_flight.drop()


def abandon_generate(core: AbandonedCore, request_ids: list[int],
                     abort: Callable[[int], None]) -> None:
    """After an error or Ctrl-C mid-generate: drop the step in flight and the call's
    requests (abort, each). Under tensor parallelism the ranks may have stopped in different
    places (one inside a collective), so the workers are stopped at once too, and the engine
    refuses further work."""
    drop_in_flight(core)
    for request_id in request_ids:
        abort(request_id)
    if core.workers is not None:
        core.workers.stop_workers_now()


def undo_step(scheduler: Scheduler, seqs: list[Sequence]) -> None:
    """A step failed before it ran (Ctrl-C, out of memory): none of its K/V was written.
    The blocks it was to fill (registered for prefix hits when it was scheduled) are
    unregistered, and its sequences go back to waiting, to be recomputed (one admitted in
    this step may hold a hit on a block that another row of this step was to write)."""
    for seq in seqs:
        seq.num_computed_tokens -= seq.num_new_tokens
        unregister_after(scheduler.block_manager, seq, seq.num_computed_tokens)
    for seq in seqs:
        if not seq.is_finished:
            scheduler.preempt(seq)


def unregister_after(block_manager: BlockManager, seq: Sequence, num_written: int) -> None:
    """Make seq's blocks past its first num_written tokens unfindable again: the step that
    was to write them was registered when it was scheduled, and then never ran."""
    keep = num_written // block_manager.block_size
    for i in range(keep, len(seq.block_hashes)):
        block = block_manager.blocks[seq.block_table[i]]
        if block_manager.hash_to_block_id.get(block.hash) == block.block_id:
            del block_manager.hash_to_block_id[block.hash]
        block.hash = -1
        block.token_ids = []
    del seq.block_hashes[keep:]
