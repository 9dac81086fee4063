"""A sequence's GrammarMatcher: the state of its output in its grammar (xgrammar)."""

from __future__ import annotations

from typing import Any

from myvllm.engine.sequence import Sequence


def new_matcher(grammar: Any) -> Any:
    """A GrammarMatcher of a CompiledGrammar, at the start of an output."""
    import xgrammar as xgr

    return xgr.GrammarMatcher(grammar)


def set_matcher(seq: Sequence, grammar: Any) -> None:
    """Give seq a matcher of grammar, at the start of its output."""
    assert seq.extras is not None, "a grammar is a feature: its Sequence has extras"
    seq.extras.grammar_matcher = new_matcher(grammar)
