"""Type tests shared by the settings objects (Config, SamplingParams).

is_int and is_real are TypeGuards, so after ``if is_int(x)`` the type checker knows ``x`` is
an int.
"""

from __future__ import annotations

from typing import TypeGuard


def is_int(x: object) -> TypeGuard[int]:
    """An int that is not a bool: True as a block size or a top_k is a bug, not a 1."""
    return isinstance(x, int) and not isinstance(x, bool)


def is_real(x: object) -> TypeGuard[int | float]:
    """An int or a float, not a bool."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)

