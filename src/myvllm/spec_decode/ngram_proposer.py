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

Two ways to find the match, with the same answer (tests/spec_decode check it):

    NgramProposer.propose   scan the whole sequence (numpy): the definition, O(length)
                            per call, ~0.3 ms for 130 tokens and ~2.6 ms for 3,000 on the
                            development machine: host time every decode step waits for
    NgramIndex.propose      what the engine uses: one per sequence, a dict from each
                            n-gram to where it first ends, extended by the tokens appended
                            since the last call; O(k) per call. It costs host memory, about
                            150 bytes per token and n (dropped with its sequence)
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

    def new_index(self) -> NgramIndex:
        """An empty index for one sequence (its tokens are added at its first propose)."""
        return NgramIndex(self.min_n, self.max_n)

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


class NgramIndex:
    """NgramProposer.propose for one sequence whose tokens only grow, kept up to date.

    first_end[g] = the position of the last token of n-gram g's first occurrence, for every
    n-gram that has a token after it (it ends at or before position len - 2), so the
    sequence's suffix itself is never its own match until it occurs again.
    """

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.first_end: dict[tuple[int, ...], int] = {}
        self.num_indexed = 0  # the n-grams ending before this position are in first_end

    def propose(self, token_ids: list[int], max_tokens: int) -> list[int]:
        """The same tokens as NgramProposer.propose(token_ids, max_tokens)."""
        num_tokens = len(token_ids)
        if num_tokens - 1 < self.num_indexed:  # not the tokens it indexed: start over
            self.first_end.clear()
            self.num_indexed = 0
        first_end, min_n, max_n = self.first_end, self.min_n, self.max_n
        for end in range(self.num_indexed, num_tokens - 1):
            for n in range(min_n, min(max_n, end + 1) + 1):
                # setdefault: an earlier occurrence keeps its place.
                first_end.setdefault(tuple(token_ids[end + 1 - n: end + 1]), end)
        self.num_indexed = max(self.num_indexed, num_tokens - 1)
        if max_tokens <= 0 or num_tokens <= min_n:
            return []
        for n in range(min(max_n, num_tokens - 1), min_n - 1, -1):
            match = first_end.get(tuple(token_ids[num_tokens - n:]))
            if match is not None:
                return token_ids[match + 1: match + 1 + max_tokens]
        return []
