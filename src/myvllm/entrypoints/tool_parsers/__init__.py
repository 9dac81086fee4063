"""Tool-call parsers: a model's text -> OpenAI's tool_calls, one parser per format, by vLLM's
names (`myvllm serve --enable-auto-tool-choice --tool-call-parser NAME`):

    hermes        Hermes' and Qwen3's <tool_call>{"name": ..., "arguments": {...}}</tool_call>
    llama3_json   Llama 3's {"name": ..., "parameters": {...}} (calls separated by ";")

abstract_tool_parser.py: what a parser gives and how it is sent (whole, or streamed as deltas);
json_scan.py: reading a call whose JSON is still being written. The tool_choice "required" and
named-function answers are JSON the grammar forced; tool_choice.py reads them.
"""

from myvllm.entrypoints.tool_parsers.abstract_tool_parser import (
    ExtractedToolCallInformation, ParsedCall, ParsedOutput, ToolCallStream, ToolParser,
    ToolParserManager, make_tool_call_id)
from myvllm.entrypoints.tool_parsers.hermes_tool_parser import Hermes2ProToolParser
from myvllm.entrypoints.tool_parsers.llama_tool_parser import Llama3JsonToolParser

__all__ = ["ExtractedToolCallInformation", "Hermes2ProToolParser", "Llama3JsonToolParser",
           "ParsedCall", "ParsedOutput", "ToolCallStream", "ToolParser", "ToolParserManager",
           "make_tool_call_id"]
