"""SpecDecodeStats: what the proposals bought, counted as vLLM's spec_decode metrics are.

    num_drafts             verification rows (sequences that carried proposals in a step)
    num_draft_tokens       tokens proposed
    num_accepted_tokens    of those, accepted (the bonus / corrected token is not counted)
    accepted_per_position  accepted at proposal position 0, 1, ..., k-1

The mean accepted length of a row is 1 + num_accepted_tokens / num_drafts: the tokens one
verification step emits, its speed-up over a decode step at best.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One verification row: it proposed num_draft_tokens, the first num_accepted held."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_draft_tokens:
            self.accepted_per_position += [0] * (num_draft_tokens
                                                 - len(self.accepted_per_position))
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verification row (accepted + the target's own)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
