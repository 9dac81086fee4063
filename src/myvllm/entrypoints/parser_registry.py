"""Parsers by name, as vLLM keeps them: a parser class registers itself under the name a flag
gives (`@ToolParserManager.register_module("hermes")`), and the server looks it up by that
name. One registry of each kind: tool_parsers.ToolParserManager (--tool-call-parser) and
reasoning_parsers.ReasoningParserManager (--reasoning-parser).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

P = TypeVar("P")


class ParserRegistry(Generic[P]):
    def __init__(self, kind: str) -> None:
        self.kind = kind  # "tool call parser": how a refusal names what was not found
        self.parsers: dict[str, type[P]] = {}

    def register_module(self, name: str) -> Callable[[type[P]], type[P]]:
        """A class decorator: the class is the parser called name."""
        def register(parser: type[P]) -> type[P]:
            self.parsers[name] = parser
            return parser
        return register

    def get(self, name: str) -> type[P]:
        """The parser called name; ValueError naming the parsers there are."""
        parser = self.parsers.get(name)
        if parser is None:
            raise ValueError(f"unknown {self.kind} {name!r} (allowed: {self.names()})")
        return parser

    def names(self) -> str:
        """The parsers' names, as a flag's help and a refusal list them."""
        return ", ".join(sorted(self.parsers))
