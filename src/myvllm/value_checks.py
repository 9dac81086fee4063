"""Type tests shared by the settings objects (Config, SamplingParams), and the one form in
which they refuse a value, what was given and what is allowed:

    Config.block_size=0: allowed: an int >= 1

which the command line shows with the flag's name, ``--block-size 0: allowed: an int >= 1``
(entrypoints/preflight.py), and the server as its 400. The library's request checks use it too
(``prompt=None: allowed: a str or a list of int token ids``), a TypeError where the type is
what is wrong.

is_int and is_real are TypeGuards, so after ``if is_int(x)`` the type checker knows ``x`` is
an int.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeGuard, TypeVar, overload

RefusedError = TypeVar("RefusedError", bound=Exception)

# The most characters of a refused value's repr a message shows: a prompt refused for its type
# may be megabytes of text, and the server sends the message back as its 400.
MAX_SHOWN = 200


def is_int(x: object) -> TypeGuard[int]:
    """An int that is not a bool: True as a block size or a top_k is a bug, not a 1."""
    return isinstance(x, int) and not isinstance(x, bool)


def is_real(x: object) -> TypeGuard[int | float]:
    """An int or a float, not a bool."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@overload
def refusal(name: str, value: object, allowed: str) -> ValueError: ...


@overload
def refusal(name: str, value: object, allowed: str,
            error: type[RefusedError]) -> RefusedError: ...


def refusal(name: str, value: object, allowed: str,
            error: type[Exception] = ValueError) -> Exception:
    """The error refusing `value` of the setting `name`: a ValueError, or `error` (TypeError
    where the value's type is what is wrong)."""
    shown = repr(value)
    if len(shown) > MAX_SHOWN:
        shown = f"{shown[:MAX_SHOWN]}... (a {type(value).__name__})"
    return error(f"{name}={shown}: allowed: {allowed}")


def one_of(choices: Iterable[object]) -> str:
    """A setting's choices as a refusal lists them: 'auto', 'fp8'."""
    return ", ".join(map(repr, choices))
