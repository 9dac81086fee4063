"""Llama 3's JSON tool calls (vLLM's "llama3_json"): the answer is the call itself, a JSON
object with the function's name and its parameters, after an optional <|python_tag|>;
several calls are separated by ";":

    {"name": "get_weather", "parameters": {"city": "Paris"}}

An answer that does not start with "{" (or the tag) is content, all of it, as in vLLM.
"""

from __future__ import annotations

from myvllm.entrypoints.tool_parsers.abstract_tool_parser import (ParsedOutput, ToolParser,
                                                                  ToolParserManager, call_of)
from myvllm.entrypoints.tool_parsers.json_scan import scan_object, skip_whitespace

PYTHON_TAG = "<|python_tag|>"
SEPARATOR = ";"


@ToolParserManager.register_module("llama3_json")
class Llama3JsonToolParser(ToolParser):
    def parse(self, text: str, final: bool) -> ParsedOutput:
        start = len(PYTHON_TAG) if text.startswith(PYTHON_TAG) else 0
        i = skip_whitespace(text, start)
        if i == len(text) and not final:
            return ParsedOutput("")  # nothing yet that says which
        if not final and start == 0 and PYTHON_TAG.startswith(text.lstrip()):
            return ParsedOutput("")  # the tag, perhaps
        if i == len(text) or text[i] != "{":
            return ParsedOutput(text)
        parsed = ParsedOutput("")
        while i < len(text):
            scan = scan_object(text, i)
            if scan.error:
                parsed.valid = False
                return parsed
            parsed.calls.append(call_of(text, scan, final))
            if scan.end is None:
                break
            i = skip_whitespace(text, scan.end)
            if i < len(text):
                if text[i] != SEPARATOR:
                    parsed.valid = False
                    return parsed
                i = skip_whitespace(text, i + 1)
        parsed.valid = all(c.complete for c in parsed.calls) or not final
        return parsed
