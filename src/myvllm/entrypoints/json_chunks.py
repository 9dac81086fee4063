"""A large answer's JSON in pieces, so that encoding it never holds the interpreter for long.

json.dumps runs in C from start to end without letting another thread take the interpreter
lock: 8.6 MB of logprobs took 0.5 s in one call on a 2-core CPU, and an answer within the
server's 64 MiB bound (response_bounds.py) would hold it for seconds, keeping the event loop
from answering anyone (/health included) even though the answer is built in a worker thread.
Here the answer is encoded field by field, choice by choice, and a long list in slices of
LIST_SLICE items, each one short json.dumps call; between them the event loop's thread gets
its turn. The text is that of Starlette's JSONResponse (compact separators, UTF-8, no NaN).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

# Items of a list encoded in one call: 256 completions top_logprobs entries of 21 tokens
# are about 150 KB of JSON, some milliseconds.
LIST_SLICE = 256


def dumps(value: Any) -> str:
    """JSONResponse's encoding of value, in one call."""
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def answer_chunks(body: dict[str, Any]) -> Iterator[str]:
    """An answer's JSON (the same text as dumps(body)) in pieces: its fields one by one, its
    choices one by one (each may be large), and in a choice every list longer than
    LIST_SLICE (tokens, logprobs, their alternatives) in slices."""
    yield "{"
    for i, (key, value) in enumerate(body.items()):
        yield ("," if i else "") + dumps(key) + ":"
        if key == "choices":
            yield "["
            for j, choice in enumerate(value):
                if j:
                    yield ","
                yield from value_chunks(choice)
            yield "]"
        else:
            yield from value_chunks(value)
    yield "}"


def value_chunks(value: Any) -> Iterator[str]:
    """value's JSON: a dict field by field, a list longer than LIST_SLICE in slices (its
    items encoded whole: in an answer, small ones), anything else whole."""
    if isinstance(value, dict):
        yield "{"
        for i, (key, item) in enumerate(value.items()):
            yield ("," if i else "") + dumps(key) + ":"
            yield from value_chunks(item)
        yield "}"
    elif isinstance(value, list) and len(value) > LIST_SLICE:
        yield "["
        for start in range(0, len(value), LIST_SLICE):
            yield ("," if start else "") + dumps(value[start:start + LIST_SLICE])[1:-1]
        yield "]"
    else:
        yield dumps(value)


def answer_bytes(body: dict[str, Any]) -> bytes:
    """An answer's JSON as JSONResponse would send it, encoded piece by piece."""
    return "".join(answer_chunks(body)).encode()
