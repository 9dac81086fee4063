"""Async scheduling's pending tokens: a Sequence's tokens counted before their value is known.

Async scheduling plans step N+1 before step N's tokens reach the host: each sequence of step N
counts one pending token (its K/V slot, its place in a block) that the runner feeds from the
device (engine/token_pool.py) and Scheduler.postprocess fills in (Sequence.append_token takes
the oldest pending slot). What plans by length works unchanged; only what reads token values
waits (the guide's Step 6, "Async scheduling").
"""

from __future__ import annotations


class PendingTokens:
    # Sequence's
    num_tokens: int
    num_computed_tokens: int

    def __init__(self) -> None:
        # Tokens counted in num_tokens, not yet in token_ids.
        self.num_pending_tokens: int = 0
        # The row of its token in the last step's sampled-token pool (engine/token_pool.py).
        self.sampled_row: int | None = None

    def add_pending_token(self) -> None:
        self.num_tokens += 1
        self.num_pending_tokens += 1

    def drop_pending_tokens(self) -> None:
        """Forget tokens that will never be read (the sequence finished, or its step was
        abandoned); the next step recomputes from the last known token."""
        if self.num_pending_tokens:
            self.num_tokens -= self.num_pending_tokens
            self.num_pending_tokens = 0
            # The last known token's K/V came from the abandoned step: compute it again.
            self.num_computed_tokens = min(self.num_computed_tokens, self.num_tokens - 1)
