"""Hermes' and Qwen3's tool calls (vLLM's "hermes"): each call a JSON object between tags,

    Let me look that up.<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

The content is the text before the first call (vLLM's reading; text after the calls is
dropped). A call whose closing tag never came (the answer ended) still counts if its JSON is
complete.
"""

from __future__ import annotations

from myvllm.entrypoints.tool_parsers.abstract_tool_parser import (ParsedOutput, ToolParser,
                                                                  ToolParserManager, call_of,
                                                                  held_back)
from myvllm.entrypoints.tool_parsers.json_scan import scan_object

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"


@ToolParserManager.register_module("hermes")
class Hermes2ProToolParser(ToolParser):
    def parse(self, text: str, final: bool) -> ParsedOutput:
        first = text.find(TOOL_CALL_START)
        if first < 0:
            return ParsedOutput(text if final else text[:len(text) - held_back(
                text, TOOL_CALL_START)])
        parsed = ParsedOutput(text[:first])
        start = first
        while start >= 0:
            body = start + len(TOOL_CALL_START)
            end = text.find(TOOL_CALL_END, body)
            region = text[:end] if end >= 0 else text  # the call's tag ends its JSON
            scan = scan_object(region, body)
            if scan.error:
                parsed.valid = False
                return parsed
            parsed.calls.append(call_of(region, scan, final or end >= 0))
            if end < 0:
                break
            start = text.find(TOOL_CALL_START, end + len(TOOL_CALL_END))
        parsed.valid = all(c.complete for c in parsed.calls) or not final
        return parsed
