"""A sequence's GrammarMatcher: the state of its output in its grammar (xgrammar), and the
CPU time it takes in each step, bounded by Config.grammar_step_budget_ms."""

from __future__ import annotations

import time
from typing import Any

from myvllm.engine.sequence import Sequence


class TimedMatcher:
    """A GrammarMatcher whose work in a step (the bitmask, then the sampled token) is timed
    in the thread's CPU time: a busy machine's other work does not count against it.
    over_budget: the last step's work took more than budget_s; the scheduler then ends the
    request ("grammar_too_slow"). The token it accepted is valid: the output stays a prefix
    of the grammar's language."""

    def __init__(self, matcher: Any, budget_s: float) -> None:
        self._matcher = matcher
        self.budget_s = budget_s
        self.step_s = 0.0  # this step's work so far
        self.over_budget = False

    def fill_next_token_bitmask(self, bitmask: Any, row: int = 0) -> None:
        """Row `row` of bitmask: the tokens allowed next (a step's first work)."""
        start = time.thread_time()
        self._matcher.fill_next_token_bitmask(bitmask, row)
        self.step_s = time.thread_time() - start

    def accept_token(self, token_id: int) -> bool:
        """Advance past the sampled token (a step's last work); False if it is not allowed."""
        start = time.thread_time()
        accepted = bool(self._matcher.accept_token(token_id))
        self.step_s += time.thread_time() - start
        self.over_budget = self.step_s > self.budget_s
        self.step_s = 0.0
        return accepted

    def fork(self) -> TimedMatcher:
        """A matcher of its own at the same place (a fork of an n > 1 request)."""
        return TimedMatcher(self._matcher.fork(), self.budget_s)

    def accept_string(self, text: str) -> bool:
        return bool(self._matcher.accept_string(text))

    def is_terminated(self) -> bool:
        return bool(self._matcher.is_terminated())


def new_matcher(grammar: Any) -> Any:
    """A GrammarMatcher of a CompiledGrammar, at the start of an output."""
    import xgrammar as xgr

    return xgr.GrammarMatcher(grammar)


def set_matcher(seq: Sequence, grammar: Any, budget_s: float) -> None:
    """Give seq a matcher of grammar, at the start of its output, its work in a step bounded
    by budget_s of CPU time."""
    assert seq.extras is not None, "a grammar is a feature: its Sequence has extras"
    seq.extras.grammar_matcher = TimedMatcher(new_matcher(grammar), budget_s)
