"""One scheduler step's token budget, and how long a prompt's next chunk is.

The step has max_num_batched_tokens tokens for decode rows and prompt chunks. While a
streamed sequence decodes (Sequence.streamed), prompt chunks together get at most
max_prefill_tokens_while_decoding of them, so that the decode rows' step stays short, and
two corrections make every such capped step about as long (the guide's "The cap beside
decode rows" measures them):

- A chunk's attention grows with its position, so past ATTENTION_BOUND_CONTEXT a chunk of n
  tokens ending at position p costs n * p / ATTENTION_BOUND_CONTEXT of the cap.
- The prefill kernel computes queries in tiles of CHUNK_TILE rows, and a started tile costs a
  whole one, so a capped chunk that is not its prompt's last is cut to whole tiles.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from myvllm.engine.sequence import Sequence

# Beyond this position a prompt token's attention (over every token before it) costs more
# than its matmuls: 4 * layers * heads * head_dim FLOPs per token of context against
# 2 * parameters per token, ~3,800 tokens for Qwen3-0.6B (more for larger models).
ATTENTION_BOUND_CONTEXT = 4096
# The prefill kernel's query tile on GPUs (prefill_config: 128 rows, 64 for fp32 or wide
# heads): a chunk of 131 tokens at 16k costs two tiles, nearly twice one of 128.
CHUNK_TILE = 128


@dataclass
class StepBudget:
    """What is left of one step's tokens: all of them (decode rows and chunks), the share
    prompt chunks may take, and whether that share is capped (streams decoding beside)."""

    tokens: int
    prompt: int
    capped: bool

    @classmethod
    def for_step(cls, max_num_batched_tokens: int, cap: int, chunked: bool,
                 running: Iterable[Sequence]) -> StepBudget:
        """The budget of a step about to be scheduled: capped by cap (chunked prefill only)
        while a streamed running sequence decodes."""
        capped = (chunked and bool(cap)
                  and any(seq.streamed and seq.num_tokens - seq.num_computed_tokens <= 1
                          for seq in running))
        tokens = max_num_batched_tokens
        return cls(tokens, min(tokens, cap) if capped else tokens, capped)

    def take_chunk(self, start: int, remaining: int) -> int:
        """The length of the next chunk of a prompt at position `start` with `remaining`
        tokens to go, taken out of the budget."""
        chunk, cost = chunk_size(start, remaining, self.tokens, self.prompt, self.capped)
        self.tokens -= chunk
        self.prompt -= cost
        return chunk


def chunk_size(start: int, remaining: int, budget: int, prompt_budget: int,
               capped: bool) -> tuple[int, int]:
    """(tokens, cost) of the next chunk of a prompt at position `start`.

    Capped, a chunk of n tokens ending past ATTENTION_BOUND_CONTEXT costs
    n * (start + n) / ATTENTION_BOUND_CONTEXT of prompt_budget, and a chunk that is not the
    prompt's last is cut to whole CHUNK_TILEs where it holds more than one: a 16k-token
    prompt goes in chunks of 768 tokens at first (the default cap) and of 128 near its end.
    """
    if not capped:
        n = min(remaining, budget, prompt_budget)
        return n, n
    long = ATTENTION_BOUND_CONTEXT

    def cost(n: int) -> int:
        return -(-n * max(long, start + n) // long)

    # The largest n with n * max(long, start + n) / long <= prompt_budget, nearly.
    n = min(remaining, budget,
            max(1, prompt_budget * long // max(long, start + prompt_budget)))
    if CHUNK_TILE < n < remaining:
        tiles = n // CHUNK_TILE + 1  # the formula above can be one tile short
        while tiles > 1 and (tiles * CHUNK_TILE > min(budget, remaining)
                             or cost(tiles * CHUNK_TILE) > prompt_budget):
            tiles -= 1
        n = tiles * CHUNK_TILE
    return n, min(cost(n), prompt_budget)
