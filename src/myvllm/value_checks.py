"""Type tests shared by the settings objects (Config, SamplingParams), and Sequence's check of
its token ids.

is_int and is_real are TypeGuards, so after ``if is_int(x)`` the type checker knows ``x`` is
an int.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from typing import TypeGuard


def is_int(x: object) -> TypeGuard[int]:
    """An int that is not a bool: True as a block size or a top_k is a bug, not a 1."""
    return isinstance(x, int) and not isinstance(x, bool)


def is_real(x: object) -> TypeGuard[int | float]:
    """An int or a float, not a bool."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def token_id_list(token_ids: Iterable[int]) -> list[int]:
    """A new list of the token ids, each an int >= 0 (a numpy integer becomes one)."""
    # A copy: the caller may reuse or mutate its list. operator.index accepts numpy integers
    # but rejects floats and strings (plain ints skip it: prompts can be long).
    tokens = list(token_ids)
    if set(map(type, tokens)) - {int}:
        tokens = [operator.index(t) for t in tokens]
    if tokens and min(tokens) < 0:
        raise ValueError(f"token ids must be >= 0, got {min(tokens)}")
    return tokens
