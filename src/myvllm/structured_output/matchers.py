"""A sequence's GrammarMatcher: the state of its output in its grammar (xgrammar), and the
CPU time it takes in each step, which the engine's GrammarStepBudget (step_budget.py)
bounds across a step's constrained rows."""

from __future__ import annotations

import time
from typing import Any

from myvllm.engine.sequence import Sequence
from myvllm.structured_output.step_budget import GrammarStepBudget


class TimedMatcher:
    """A GrammarMatcher whose work is timed in the thread's CPU time (a busy machine's other
    work does not count against it) and charged to its engine's step budget.

    step_s: its work for the step being sampled: the acceptance of the token it sampled in
    the step before, then this step's bitmask row. over_budget: the step budget ended it
    (step_budget.py): the token it samples in this step is its last, and the scheduler then
    ends the request ("grammar_too_slow")."""

    def __init__(self, matcher: Any, budget: GrammarStepBudget) -> None:
        self._matcher = matcher
        self.budget = budget
        self.step_s = 0.0
        self._accept_s = 0.0  # its last token's acceptance, counted in its next step
        self.over_budget = False

    def fill_next_token_bitmask(self, bitmask: Any, row: int = 0) -> None:
        """Row `row` of bitmask: the tokens allowed next."""
        start, wall_start = time.thread_time(), time.perf_counter()
        self._matcher.fill_next_token_bitmask(bitmask, row)
        self.budget.charge(time.perf_counter() - wall_start)
        self.step_s = self._accept_s + time.thread_time() - start
        self._accept_s = 0.0

    def accept_token(self, token_id: int) -> bool:
        """Advance past the sampled token; False if it is not allowed."""
        if self.over_budget:
            # Its last token (its bitmask allowed it): its request ends now, so the matcher,
            # the costliest of its step, need not take its time again.
            return True
        start, wall_start = time.thread_time(), time.perf_counter()
        accepted = bool(self._matcher.accept_token(token_id))
        self.budget.charge(time.perf_counter() - wall_start)
        self._accept_s = time.thread_time() - start
        return accepted

    def fork(self) -> TimedMatcher:
        """A matcher of its own at the same place (a fork of an n > 1 request)."""
        return TimedMatcher(self._matcher.fork(), self.budget)

    def accept_string(self, text: str) -> bool:
        return bool(self._matcher.accept_string(text))

    def is_terminated(self) -> bool:
        return bool(self._matcher.is_terminated())


def new_matcher(grammar: Any) -> Any:
    """A GrammarMatcher of a CompiledGrammar, at the start of an output."""
    import xgrammar as xgr

    return xgr.GrammarMatcher(grammar)


def set_matcher(seq: Sequence, grammar: Any, budget: GrammarStepBudget) -> None:
    """Give seq a matcher of grammar, at the start of its output, its work charged to
    budget (its engine's)."""
    assert seq.extras is not None, "a grammar is a feature: its Sequence has extras"
    seq.extras.grammar_matcher = TimedMatcher(new_matcher(grammar), budget)
