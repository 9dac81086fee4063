"""The grammar work one step may take, so that constrained rows never stall the others.

A step's grammar work is what its constrained rows' matchers do on the host between two of
their forwards: each accepts the token it sampled in the step before, then fills its row of
this step's bitmask (CPU time of the thread, so that a busy machine's other work does not
count). It may take

    limit = max(Config.grammar_step_budget_ms,
                Config.grammar_step_budget_multiple x the step's time without it)

so a step with constrained rows takes at most (1 + multiple) times one without, or the floor
more: the floor keeps a tiny step (a small model on a CPU) from ending every grammar. The
step without grammar work is measured by the engine's own steps: the wall time from one
constrained step's bitmask to the next one's, less the grammar work between them (its wall
time here: a matcher preempted by another process would otherwise lengthen the step); the
smallest of the last NUM_STEPS_MEASURED (a gap that spans idle time, or steps in which no
constrained row sampled, only makes it longer, so the smallest is the closest to one step).
Until one is measured, the floor alone.

A step whose grammar work goes over ends its costliest rows, costliest first, until what the
others cost fits the limit; one row over the limit alone is ended whatever the others do.
Each ended row keeps the token it samples in this step (its bitmask allowed it, so its text
is still a prefix of the grammar's language) and its request ends with finish_reason
"grammar_too_slow"; the others carry on. The work is measured only once done (a matcher's
call cannot be interrupted), so the step that crosses the limit runs over it; a matcher's
cost grows token by token (an ambiguous grammar's), so the next steps are back within it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Protocol

# How many recent steps' times without grammar work the limit looks at (their smallest).
NUM_STEPS_MEASURED = 16


class RowWork(Protocol):
    """A constrained row's matcher (matchers.TimedMatcher), as the budget sees it."""

    step_s: float  # its work in the step being sampled
    over_budget: bool  # ended by the budget: the token it samples now is its last


class GrammarStepBudget:
    """The limit on one step's grammar work, shared by the matchers of one engine (its
    StructuredOutputManager.step_budget)."""

    def __init__(self, floor_s: float, multiple: float) -> None:
        """floor_s, multiple: Config.grammar_step_budget_ms (in seconds) and
        grammar_step_budget_multiple."""
        self.floor_s = floor_s
        self.multiple = multiple
        self._step_began: float | None = None  # time.perf_counter() at the last bitmask
        self._work_s = 0.0  # grammar work since then, in wall time (the matchers charge it)
        self._steps_s: deque[float] = deque(maxlen=NUM_STEPS_MEASURED)

    def charge(self, seconds: float) -> None:
        """A matcher's work (a bitmask row, an accepted token), in wall time: what it kept
        the step from doing, preempted or not."""
        self._work_s += seconds

    def begin_step(self, now: float) -> None:
        """A step's bitmask is about to be filled (now: time.perf_counter()): the time since
        the last one, less the grammar work in it, is a step without grammar work."""
        if self._step_began is not None:
            self._steps_s.append(max(0.0, now - self._step_began - self._work_s))
        self._step_began = now
        self._work_s = 0.0

    def limit_s(self) -> float:
        """What this step's grammar work may take."""
        if not self._steps_s:
            return self.floor_s
        return max(self.floor_s, self.multiple * min(self._steps_s))

    def end_costliest(self, rows: Sequence[RowWork]) -> list[RowWork]:
        """Once a step's bitmask is filled: end its costliest rows until the others' work
        fits limit_s(); returns those ended (none when the step is within it)."""
        limit = self.limit_s()
        total = sum(row.step_s for row in rows)
        ended: list[RowWork] = []
        for row in sorted(rows, key=lambda row: row.step_s, reverse=True):
            if total <= limit:
                break
            row.over_budget = True
            total -= row.step_s
            ended.append(row)
        return ended
