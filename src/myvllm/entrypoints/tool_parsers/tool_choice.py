"""tool_choice "required" and a named function: the answer is forced to be a call.

The request's sampling gets a JSON schema (structured outputs, as response_format's
json_schema is run), so that even a small model writes a valid call; its answer is then that
JSON, read here:

    named function   {"type": "function", "function": {"name": "f"}}
                     schema: f's parameters; the answer is the arguments themselves
    "required"       schema: an array of one call or more (one, without parallel_tool_calls),
                     each {"name": one of the tools, "parameters": that tool's parameters}

(vLLM's schemas and readings.) The chat template still shows the tools to the model.
"""

from __future__ import annotations

from typing import Any

from myvllm.entrypoints.tool_parsers.abstract_tool_parser import (ParsedCall, ParsedOutput,
                                                                  ToolParser, call_of)
from myvllm.entrypoints.tool_parsers.json_scan import scan_array

# A function that declares no parameters takes none: {} is its one call's arguments.
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


def parameters_schema(function: dict[str, Any]) -> dict[str, Any]:
    return function.get("parameters") or NO_PARAMETERS


def named_function_schema(tools: list[dict[str, Any]], name: str) -> dict[str, Any]:
    """The schema of a named function's arguments (name is one of tools', checked before)."""
    function = next(t["function"] for t in tools if t["function"]["name"] == name)
    return parameters_schema(function)


def required_schema(tools: list[dict[str, Any]], parallel_tool_calls: bool) -> dict[str, Any]:
    """The schema of tool_choice "required"'s answer: a list of calls of the tools."""
    calls = [{"type": "object", "additionalProperties": False,
              "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                             "parameters": parameters_schema(t["function"])},
              "required": ["name", "parameters"]} for t in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    return schema


class NamedFunctionParser(ToolParser):
    """A named function's answer: its arguments' JSON, all of it."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def parse(self, text: str, final: bool) -> ParsedOutput:
        return ParsedOutput("", [ParsedCall(self.name, text.lstrip(), complete=final)])


class RequiredToolParser(ToolParser):
    """tool_choice "required"'s answer: [{"name": ..., "parameters": {...}}, ...]."""

    def parse(self, text: str, final: bool) -> ParsedOutput:
        objects, end, error = scan_array(text)
        parsed = ParsedOutput("", [call_of(text, scan, final) for scan in objects])
        parsed.valid = not error and (not final or end is not None)
        return parsed
