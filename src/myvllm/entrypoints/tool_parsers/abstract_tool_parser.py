"""What every tool-call parser gives, and the two ways its result is sent.

A parser reads the model's whole output so far and says what of it is content and what is
tool calls (ParsedOutput). It is called on the complete text for a non-streamed answer
(extract_tool_calls) and on each longer prefix of it while streaming (ToolCallStream), so the
streamed deltas and the non-streamed answer come from the same reading. What a parser reports
only grows as the text does: content that might still turn out to be the start of a tool-call
tag is held back until it cannot.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from myvllm.entrypoints.parser_registry import ParserRegistry
from myvllm.entrypoints.tool_parsers.json_scan import ObjectScan, stable_text, string_value


def make_tool_call_id() -> str:
    """OpenAI's shape of a tool call's id: "call_" and 24 characters."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ParsedCall:
    name: str | None  # None until the model has written its whole name
    arguments: str  # the arguments' JSON text so far (all of it once the call is complete)
    complete: bool = False


@dataclass
class ParsedOutput:
    content: str  # the text that is not a tool call, as far as it is sure
    calls: list[ParsedCall] = field(default_factory=list)
    valid: bool = True  # False: the text holds something that is not a valid call

    @property
    def tools_called(self) -> bool:
        return self.valid and bool(self.calls) and all(c.complete for c in self.calls)


@dataclass
class ExtractedToolCallInformation:
    """A complete answer read by a parser (vLLM's name): the calls in OpenAI's shape."""

    tools_called: bool
    tool_calls: list[dict[str, Any]]
    content: str | None


def tool_call(name: str, arguments: str, call_id: str | None = None) -> dict[str, Any]:
    return {"id": call_id or make_tool_call_id(), "type": "function",
            "function": {"name": name, "arguments": arguments}}


def held_back(text: str, tag: str) -> int:
    """The length of the longest end of text that is the beginning of tag (but not all of
    it): text that may yet become the tag, so not content yet."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def is_valid_call(text: str) -> bool:
    """text is one complete JSON call: {"name": "...", "arguments" (or "parameters"): {...}},
    the arguments optional."""
    try:
        call = json.loads(text)
    except ValueError:
        return False
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return False
    return isinstance(call.get("arguments", call.get("parameters", {})), dict)


def call_of(text: str, scan: ObjectScan, final: bool) -> ParsedCall:
    """The call that scan (of a call object in text) shows so far. Complete: its object is
    closed (or final) and valid; its arguments then default to {}."""
    span = scan.values.get("arguments", scan.values.get("parameters"))
    call = ParsedCall(string_value(text, scan.values.get("name")), stable_text(text, span))
    if scan.end is not None or final:
        end = scan.end if scan.end is not None else len(text)
        call.complete = is_valid_call(text[scan.start:end])
        if call.complete and span is None:
            call.arguments = "{}"
    return call


class ToolParser:
    """One request's reader of tool calls (vLLM's ToolParser). A subclass registered with
    ToolParserManager implements parse()."""

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer

    def parse(self, text: str, final: bool) -> ParsedOutput:
        """What text (the output so far; final: all of it) holds."""
        raise NotImplementedError

    def extract_tool_calls(self, model_output: str) -> ExtractedToolCallInformation:
        """A complete answer: its calls, or none and all of it as content if any call is
        not valid (as vLLM answers a malformed call)."""
        parsed = self.parse(model_output, final=True)
        if not parsed.tools_called:
            return ExtractedToolCallInformation(False, [], model_output)
        calls = [tool_call(c.name or "", c.arguments) for c in parsed.calls]
        content = parsed.content if parsed.content.strip() else None
        return ExtractedToolCallInformation(True, calls, content)


# The tool-call parsers by name (vLLM's registry and names; --tool-call-parser).
ToolParserManager: ParserRegistry[ToolParser] = ParserRegistry("tool call parser")


@dataclass
class _SentCall:
    id: str
    arguments_sent: int = 0


class ToolCallStream:
    """One streamed choice: its output's text goes in piece by piece, the deltas of OpenAI's
    stream come out: content, and for each tool call its index, id, type and name once, then
    its arguments in fragments (vLLM streams them so)."""

    def __init__(self, parser: ToolParser, max_calls: int | None = None) -> None:
        """max_calls: the calls sent at most (parallel_tool_calls false: 1)."""
        self.parser = parser
        self.max_calls = max_calls
        self.text = ""
        self.content_sent = 0
        self.calls: list[_SentCall] = []

    @property
    def tools_called(self) -> bool:
        return bool(self.calls)

    def delta(self, text: str, final: bool = False) -> dict[str, Any]:
        """The delta for text, the output's next piece (final: the output ends with it)."""
        self.text += text
        parsed = self.parser.parse(self.text, final)
        delta: dict[str, Any] = {}
        if len(parsed.content) > self.content_sent:
            delta["content"] = parsed.content[self.content_sent:]
            self.content_sent = len(parsed.content)
        entries = []
        for index, call in enumerate(parsed.calls[:self.max_calls]):
            entry: dict[str, Any] = {"index": index}
            function: dict[str, str] = {}
            if index == len(self.calls):
                if call.name is None:
                    break
                self.calls.append(_SentCall(make_tool_call_id()))
                entry.update(id=self.calls[index].id, type="function")
                function["name"] = call.name
            sent = self.calls[index]
            if len(call.arguments) > sent.arguments_sent:
                function["arguments"] = call.arguments[sent.arguments_sent:]
                sent.arguments_sent = len(call.arguments)
            if function:
                entry["function"] = function
                entries.append(entry)
        if entries:
            delta["tool_calls"] = entries
        return delta
