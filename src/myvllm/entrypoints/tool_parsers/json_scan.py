"""Reading a JSON tool call while it is still being written.

A streamed tool call is sent as its name, once complete, then its arguments' text as it grows:
so a parser must know, at any prefix of the model's output, where the name and the arguments
of each call are, without a complete JSON document to hand to json.loads. scan_object walks a
JSON object that a text begins and reports each top-level key's value span as far as the text
goes; scan_array does the same for the objects of an array (tool_choice "required"'s output).

The arguments sent are the model's own text of the value (its spacing kept), so the fragments
streamed add up to exactly the arguments of the non-streamed answer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

WHITESPACE = " \t\n\r"


@dataclass
class ValueSpan:
    start: int  # where the value's text starts
    end: int | None = None  # just past its end; None while the text stops inside it
    is_container: bool = False  # an object or an array: its text so far is final text


@dataclass
class ObjectScan:
    """A JSON object as far as the text goes."""

    start: int  # where its "{" is
    values: dict[str, ValueSpan] = field(default_factory=dict)
    end: int | None = None  # just past its "}"; None while it is open
    error: bool = False  # the text is not (the beginning of) a JSON object


def skip_whitespace(text: str, i: int) -> int:
    while i < len(text) and text[i] in WHITESPACE:
        i += 1
    return i


def _string_end(text: str, i: int) -> int | None:
    """Just past the string whose opening quote is at i; None if the text ends inside it."""
    i += 1
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == '"':
            return i + 1
        i += 1
    return None


def _value_end(text: str, i: int) -> tuple[int | None, bool]:
    """Just past the JSON value starting at i (None: the text ends inside it), and whether
    it is a container. Only the brackets and the strings are followed: a malformed value is
    json.loads' to refuse once the call is complete."""
    c = text[i]
    if c == '"':
        return _string_end(text, i), False
    if c not in "{[":
        # A number or a literal: it ends where a delimiter comes (not yet: it may go on).
        j = i
        while j < len(text) and text[j] not in ",}] \t\n\r":
            j += 1
        return (j if j < len(text) else None), False
    depth = 0
    while i < len(text):
        c = text[i]
        if c == '"':
            end = _string_end(text, i)
            if end is None:
                return None, True
            i = end
            continue
        if c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1, True
        i += 1
    return None, True


def scan_object(text: str, start: int = 0) -> ObjectScan:
    """The object that text begins at start (after whitespace), as far as the text goes."""
    i = skip_whitespace(text, start)
    scan = ObjectScan(i)
    if i == len(text):
        return scan  # nothing yet
    if text[i] != "{":
        scan.error = True
        return scan
    i = skip_whitespace(text, i + 1)
    if i < len(text) and text[i] == "}":
        scan.end = i + 1
        return scan
    while i < len(text):
        if text[i] != '"':
            scan.error = True
            return scan
        key_end = _string_end(text, i)
        if key_end is None:
            return scan
        try:
            key = json.loads(text[i:key_end])
        except ValueError:  # a bad escape in the key
            scan.error = True
            return scan
        i = skip_whitespace(text, key_end)
        if i == len(text):
            return scan
        if text[i] != ":":
            scan.error = True
            return scan
        i = skip_whitespace(text, i + 1)
        if i == len(text):
            return scan
        end, is_container = _value_end(text, i)
        scan.values[key] = ValueSpan(i, end, is_container)
        if end is None:
            return scan
        i = skip_whitespace(text, end)
        if i == len(text):
            return scan
        if text[i] == "}":
            scan.end = i + 1
            return scan
        if text[i] != ",":
            scan.error = True
            return scan
        i = skip_whitespace(text, i + 1)
    return scan


def scan_array(text: str, start: int = 0) -> tuple[list[ObjectScan], int | None, bool]:
    """The objects of the array that text begins at start, as far as the text goes; just
    past its "]" (None while open); and whether the text is not such an array."""
    i = skip_whitespace(text, start)
    if i == len(text):
        return [], None, False
    if text[i] != "[":
        return [], None, True
    objects: list[ObjectScan] = []
    i = skip_whitespace(text, i + 1)
    while i < len(text):
        if text[i] == "]" and not objects:
            return objects, i + 1, False
        scan = scan_object(text, i)
        objects.append(scan)
        if scan.error or scan.end is None:
            return objects, None, scan.error
        i = skip_whitespace(text, scan.end)
        if i == len(text):
            break
        if text[i] == "]":
            return objects, i + 1, False
        if text[i] != ",":
            return objects, None, True
        i = skip_whitespace(text, i + 1)
    return objects, None, False


def stable_text(text: str, span: ValueSpan | None) -> str:
    """A value's text that will not change as the text grows: all of it once complete, the
    part so far of an object or array, nothing of an unfinished string or number."""
    if span is None:
        return ""
    if span.end is not None:
        return text[span.start:span.end]
    return text[span.start:] if span.is_container else ""


def string_value(text: str, span: ValueSpan | None) -> str | None:
    """A complete string value, decoded (None: not there yet, or not a string)."""
    if span is None or span.end is None or text[span.start] != '"':
        return None
    try:
        value = json.loads(text[span.start:span.end])
    except ValueError:  # a bad escape: not a name json.loads would take either
        return None
    return value if isinstance(value, str) else None
