"""A chat answer read as more than text: reasoning split off, tool calls parsed (vLLM's
--reasoning-parser, --enable-auto-tool-choice and --tool-call-parser).

    ChatOutputSettings   the server's flags, checked before the model loads
    output_parsing()     one request's ChatOutputParsing, or None: nothing to read (the answer
                         is its text, as without these flags); a 400 for tool_choice "auto" on
                         a server without the flags
    ChatOutputParsing    a whole answer -> message (content, reasoning_content, tool_calls) and
                         its finish_reason; .stream() -> ChatOutputStream: the same as deltas

The reasoning comes first in an answer: the tool calls are read from what follows it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from myvllm.entrypoints.protocol import (ChatCompletionNamedToolChoiceParam,
                                         ChatCompletionRequest, RequestError)
from myvllm.entrypoints.reasoning_parsers import (ReasoningParser, ReasoningParserManager,
                                                  ReasoningStream)
from myvllm.entrypoints.tool_parsers import ToolCallStream, ToolParser, ToolParserManager
from myvllm.entrypoints.tool_parsers.tool_choice import NamedFunctionParser, RequiredToolParser

AUTO_NEEDS_FLAGS = ('"auto" tool choice requires --enable-auto-tool-choice and '
                    "--tool-call-parser to be set")


@dataclass(frozen=True)
class ChatOutputSettings:
    """The server's flags that read chat answers (vLLM's names)."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None

    def check(self) -> None:
        """ValueError for a parser not known, or auto tool choice without a parser."""
        if self.tool_call_parser is not None:
            try:
                ToolParserManager.get(self.tool_call_parser)
            except ValueError as e:
                raise ValueError(f"--tool-call-parser: {e}") from None
        elif self.enable_auto_tool_choice:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser NAME "
                             f"(allowed: {ToolParserManager.names()})")
        if self.reasoning_parser is not None:
            try:
                ReasoningParserManager.get(self.reasoning_parser)
            except ValueError as e:
                raise ValueError(f"--reasoning-parser: {e}") from None


def output_parsing(body: ChatCompletionRequest, settings: ChatOutputSettings | None,
                   tokenizer: Any = None) -> ChatOutputParsing | None:
    """How body's answers are read; None when as plain text."""
    settings = settings or ChatOutputSettings()
    mode = body.tool_mode
    tools: Callable[[], ToolParser] | None = None
    if mode == "auto":
        if not (settings.enable_auto_tool_choice and settings.tool_call_parser):
            raise RequestError(AUTO_NEEDS_FLAGS, param="tool_choice")
        parser = ToolParserManager.get(settings.tool_call_parser)
        tools = lambda: parser(tokenizer)  # noqa: E731
    elif mode == "required":
        tools = RequiredToolParser
    elif isinstance(body.tool_choice, ChatCompletionNamedToolChoiceParam) and mode == "named":
        name = body.tool_choice.function.name
        tools = lambda: NamedFunctionParser(name)  # noqa: E731
    reasoning = None
    if settings.reasoning_parser is not None:
        reasoning_class = ReasoningParserManager.get(settings.reasoning_parser)
        reasoning = lambda: reasoning_class(tokenizer)  # noqa: E731
    if tools is None and reasoning is None:
        return None
    max_calls = 1 if body.parallel_tool_calls is False else None
    return ChatOutputParsing(mode, tools, reasoning, max_calls)


@dataclass
class ChatOutputParsing:
    """One request's reading of its answers (each choice's, whole or streamed)."""

    tool_mode: str | None
    tools: Callable[[], ToolParser] | None
    reasoning: Callable[[], ReasoningParser] | None
    max_calls: int | None = None  # parallel_tool_calls false: the first call only

    def finish_reason(self, finish_reason: str | None, tools_called: bool) -> str | None:
        """vLLM's: "tool_calls" once "auto" found calls, or "required"'s answer ended
        normally; a named function's answer keeps its own (as OpenAI answers it)."""
        if tools_called and (self.tool_mode == "auto" or (self.tool_mode == "required"
                                                          and finish_reason == "stop")):
            return "tool_calls"
        return finish_reason

    def message(self, text: str, finish_reason: str | None
                ) -> tuple[dict[str, Any], str | None]:
        """A whole answer's message, and its finish_reason."""
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if self.reasoning is not None:
            split = self.reasoning().split(text, final=True)
            text = split.content
            # Only thinking (cut short by max_tokens): no content, as vLLM answers it.
            message.update(content=text if text or split.reasoning is None else None,
                           reasoning_content=split.reasoning)
        if self.tools is None:
            return message, finish_reason
        info = self.tools().extract_tool_calls(text)
        if not info.tools_called:
            return message, finish_reason
        message.update(content=info.content, tool_calls=info.tool_calls[:self.max_calls])
        return message, self.finish_reason(finish_reason, True)

    def stream(self) -> ChatOutputStream:
        return ChatOutputStream(self)


class ChatOutputStream:
    """One streamed choice's deltas: reasoning_content, content and tool calls."""

    def __init__(self, parsing: ChatOutputParsing) -> None:
        self.parsing = parsing
        self.reasoning = (ReasoningStream(parsing.reasoning()) if parsing.reasoning
                          else None)
        self.tools = (ToolCallStream(parsing.tools(), parsing.max_calls) if parsing.tools
                      else None)

    def delta(self, text: str, final: bool) -> dict[str, Any]:
        """The delta of the output's next piece of text (final: the output ends here)."""
        delta: dict[str, Any] = {}
        content = text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.delta(text, final)
            if reasoning:
                delta["reasoning_content"] = reasoning
        if self.tools is not None:
            delta.update(self.tools.delta(content, final))
        elif content:
            delta["content"] = content
        return delta

    def finish_reason(self, finish_reason: str | None) -> str | None:
        if finish_reason is None or self.tools is None:
            return finish_reason
        return self.parsing.finish_reason(finish_reason, self.tools.tools_called)
