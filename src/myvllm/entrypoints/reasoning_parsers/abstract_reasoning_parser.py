"""What a reasoning parser gives: the output so far split into reasoning and content, each
only growing as the text does (a tag's beginning is held back until it is sure), so that the
streamed deltas add up to the non-streamed answer's fields."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from myvllm.entrypoints.parser_registry import ParserRegistry


@dataclass
class SplitOutput:
    reasoning: str | None  # None: the output holds no reasoning
    content: str


class ReasoningParser:
    """One request's reader of reasoning (vLLM's ReasoningParser)."""

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer

    def split(self, text: str, final: bool) -> SplitOutput:
        """text, the output so far (final: all of it), as reasoning and content."""
        raise NotImplementedError


# The reasoning parsers by name (vLLM's registry and names; --reasoning-parser).
ReasoningParserManager: ParserRegistry[ReasoningParser] = ParserRegistry("reasoning parser")


class ReasoningStream:
    """One streamed choice: text in, the new reasoning and the new content out."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self.text = ""
        self.reasoning_sent = 0
        self.content_sent = 0

    def delta(self, text: str, final: bool = False) -> tuple[str, str]:
        """(new reasoning, new content) once text, the output's next piece, is added."""
        self.text += text
        split = self.parser.split(self.text, final)
        reasoning = (split.reasoning or "")[self.reasoning_sent:]
        content = split.content[self.content_sent:]
        self.reasoning_sent += len(reasoning)
        self.content_sent += len(content)
        return reasoning, content
