"""The compiled grammars an engine keeps for reuse, bounded in bytes, not in entries.

One grammar's size varies by orders of magnitude (a small JSON schema: a few hundred KB with
a 150k-token vocabulary; a list of thousands of choices: tens of MB), so a count of entries
bounds nothing. Each entry is charged xgrammar's own count of its bytes
(CompiledGrammar.memory_size_bytes) plus its key's text; the least recently used go first.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

GrammarKey = tuple[str, str, bool]  # StructuredOutputsParams.key()


def grammar_bytes(key: GrammarKey, grammar: Any) -> int:
    """What keeping `grammar` under `key` costs: its compiled tables and the key's text."""
    return int(grammar.memory_size_bytes) + len(key[1])


class GrammarCache:
    """Least-recently-used compiled grammars within max_bytes (0: keep none)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._grammars: OrderedDict[GrammarKey, tuple[Any, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._grammars)

    def get(self, key: GrammarKey) -> Any:
        """The grammar kept under key (now the most recently used), or None."""
        entry = self._grammars.get(key)
        if entry is None:
            return None
        self._grammars.move_to_end(key)
        return entry[0]

    def put(self, key: GrammarKey, grammar: Any) -> None:
        """Keep grammar, dropping the least recently used until it fits; one larger than the
        whole bound is not kept (its request uses it all the same)."""
        size = grammar_bytes(key, grammar)
        if size > self.max_bytes or key in self._grammars:
            return
        while self.num_bytes + size > self.max_bytes:
            _, (_, dropped) = self._grammars.popitem(last=False)
            self.num_bytes -= dropped
        self._grammars[key] = (grammar, size)
        self.num_bytes += size
