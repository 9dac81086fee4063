"""The cost and length of a prompt chunk scheduled beside decode rows (StepBudget.capped, in
engine/scheduler.py): the corrections that make every capped step about as long."""

from __future__ import annotations

# Beyond this position a prompt token's attention (over every token before it) costs more
# than its matmuls: 4 * layers * heads * head_dim FLOPs per token of context against
# 2 * parameters per token, ~3,800 tokens for Qwen3-0.6B (more for larger models).
ATTENTION_BOUND_CONTEXT = 4096
# The prefill kernel's query tile on GPUs (prefill_config: 128 rows, 64 for fp32 or wide
# heads): a chunk of 131 tokens at 16k costs two tiles, nearly twice one of 128.
CHUNK_TILE = 128


def capped_chunk_size(start: int, remaining: int, budget: int,
                      prompt_budget: int) -> tuple[int, int]:
    """(tokens, cost) of the next chunk of a prompt at position `start`.

    Capped, a chunk of n tokens ending past ATTENTION_BOUND_CONTEXT costs
    n * (start + n) / ATTENTION_BOUND_CONTEXT of prompt_budget, and a chunk that is not the
    prompt's last is cut to whole CHUNK_TILEs where it holds more than one: a 16k-token
    prompt goes in chunks of 768 tokens at first (the default cap) and of 128 near its end.
    """
    long = ATTENTION_BOUND_CONTEXT

    def cost(n: int) -> int:
        return -(-n * max(long, start + n) // long)

    # The largest n with n * max(long, start + n) / long <= prompt_budget, nearly.
    n = min(remaining, budget,
            max(1, prompt_budget * long // max(long, start + prompt_budget)))
    if CHUNK_TILE < n < remaining:
        # The formula prices every token at the position the whole cap would reach, so it
        # comes out short (by dozens of tiles for a cap of 15k tokens): from the whole tiles
        # it gives, which fit, add tiles while one more fits the budget and the cap.
        tiles = n // CHUNK_TILE
        while ((tiles + 1) * CHUNK_TILE <= min(budget, remaining)
               and cost((tiles + 1) * CHUNK_TILE) <= prompt_budget):
            tiles += 1
        n = tiles * CHUNK_TILE
    return n, min(cost(n), prompt_budget)
