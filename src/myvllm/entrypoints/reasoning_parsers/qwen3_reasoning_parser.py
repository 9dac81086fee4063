"""Qwen3's thinking (vLLM's "qwen3"): an answer that starts with <think> thinks until
</think>, then answers:

    <think>
    The user wants ...
    </think>

    Paris is the capital of France.

The reasoning is the text between the tags (all the rest of the answer, if it ended while
thinking); the content is what follows </think>, its leading blank lines dropped. An answer
without <think> (enable_thinking false: the template closed the thinking in the prompt) is
all content.
"""

from __future__ import annotations

from myvllm.entrypoints.reasoning_parsers.abstract_reasoning_parser import (
    ReasoningParser, ReasoningParserManager, SplitOutput)
from myvllm.entrypoints.tool_parsers.abstract_tool_parser import held_back

THINK_START = "<think>"
THINK_END = "</think>"


@ReasoningParserManager.register_module("qwen3")
class Qwen3ReasoningParser(ReasoningParser):
    def split(self, text: str, final: bool) -> SplitOutput:
        opened = text.lstrip()
        if not opened.startswith(THINK_START):
            if not final and THINK_START.startswith(opened):
                return SplitOutput(None, "")  # <think>, perhaps
            return SplitOutput(None, text)
        thinking = opened[len(THINK_START):]
        end = thinking.find(THINK_END)
        if end < 0:
            keep = len(thinking) if final else len(thinking) - held_back(thinking, THINK_END)
            return SplitOutput(thinking[:keep], "")
        return SplitOutput(thinking[:end], thinking[end + len(THINK_END):].lstrip())
