"""Prompt lookup (vLLM's "ngram" proposer): the next tokens of a sequence guessed from an
earlier place where its last few tokens already occurred.

    tokens   ... the cat sat on the mat . the cat sat ?
                 ^^^^^^^^^^^ match              ^^^^^^^ suffix (n = 3)
    proposal              on the mat            the k tokens that followed the match

The suffix is tried longest first (prompt_lookup_max down to prompt_lookup_min): a longer
match is a better guess. The first (earliest) occurrence wins, as in vLLM. Text that copies
its input (summaries, edits, code changes, quoted passages) matches often, and then every
accepted token costs a share of one forward pass instead of one whole pass; free text matches
rarely and then the proposer proposes nothing, and the step is a plain decode step.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{prompt_lookup_min} and {prompt_lookup_max}")
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, token_ids: list[int], max_tokens: int) -> list[int]:
        """Up to max_tokens tokens that followed the longest earlier match of the sequence's
        last n tokens (min_n <= n <= max_n); [] when nothing matches."""
        num_tokens = len(token_ids)
        if max_tokens <= 0 or num_tokens <= self.min_n:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, num_tokens - 1), self.min_n - 1, -1):
            suffix = tokens[num_tokens - n:]
            # Windows starting at 0 .. num_tokens - n - 1: every earlier n-gram, not the
            # suffix itself, and each has at least one token after it.
            windows = sliding_window_view(tokens[:num_tokens - 1], n)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if hits.size:
                start = int(hits[0]) + n
                return tokens[start:start + max_tokens].tolist()
        return []
