"""Randomized end-to-end check: the real engine under pressure gives one-at-a-time tokens.

test_scheduler_properties.py drives Scheduler + BlockManager with a fake model. This file
drives the whole LLMEngine (ModelRunner, paged KV cache, prefill over cached prefixes) with a
tiny random checkpoint on the CPU, in the conditions where bookkeeping bugs show:

    random batches of prompts that share prefixes      -> prefix-cache hits, shared blocks
    block_size 1..8 and a KV pool barely larger than    -> decode preemption, re-prefill of
      the longest single sequence needs                    prompt + completion so far
    several generate() calls on one engine             -> hits on blocks of finished requests
    several eos ids, max_tokens up to the context      -> sequences stop at different steps

Oracle: every prompt generated ALONE (greedy, same eos and max_model_length) on a fresh,
roomy engine without prefix caching. Each random engine runs twice, prefix caching on and off,
and both must give the oracle's tokens. A wrong block table, a block reused after another
prefix, a shared block overwritten, or a token lost in preemption changes the K/V that
attention reads, and with untied random weights that changes the greedy tokens.

Trials: MYVLLM_RANDOM_ENGINE_TRIALS (default 16; raise it locally for a longer soak).
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from helpers_models import tiny_checkpoint

from myvllm import LLM, SamplingParams
from helpers_blocks import used_block_ids

TRIALS = int(os.environ.get("MYVLLM_RANDOM_ENGINE_TRIALS", "16"))
VOCAB = 256  # helpers_models.TINY_DIMS
# Untied random models: their greedy tokens depend on the whole context. (The tied tiny
# models mostly repeat the last prompt token, which would hide a wrong K/V read.)
KINDS = ("llama", "qwen3_bias")
# Several eos ids that these models emit now and then, so some sequences stop early.
EOS = (0, 50, 71, 109, 152, 217)
REFERENCE_BLOCK_SIZE = 16


@dataclass(frozen=True)
class Request:
    prompt: tuple[int, ...]
    max_tokens: int
    ignore_eos: bool

    def params(self) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=self.max_tokens,
                              ignore_eos=self.ignore_eos)


@dataclass
class Oracle:
    """One-at-a-time greedy tokens, each request on a fresh roomy engine (memoized)."""

    path: str
    max_model_length: int
    memo: dict[Request, list[int]] = field(default_factory=dict)

    def __call__(self, req: Request) -> list[int]:
        if req not in self.memo:
            blocks = -(-self.max_model_length // REFERENCE_BLOCK_SIZE)
            llm = LLM(self.path, block_size=REFERENCE_BLOCK_SIZE, num_kvcache_blocks=blocks,
                      max_num_sequences=1, max_model_length=self.max_model_length,
                      max_num_batched_tokens=self.max_model_length, eos=EOS,
                      enable_prefix_caching=False, enable_chunked_prefill=False)
            out = llm.generate([list(req.prompt)], req.params(), use_tqdm=False)[0]
            assert out["num_cached_tokens"] == 0
            self.memo[req] = out["token_ids"]
        return self.memo[req]


def random_batch(rng: random.Random, prefixes: list[list[int]], max_model_length: int,
                 size: int) -> list[Request]:
    """Prompts = (often) a shared prefix, cut anywhere, plus a random tail."""
    batch = []
    for _ in range(size):
        prompt: list[int] = []
        if rng.random() < 0.75:
            prefix = rng.choice(prefixes)
            prompt = prefix[: rng.randint(1, len(prefix))]
        prompt += [rng.randrange(1, VOCAB) for _ in range(rng.randint(0 if prompt else 1, 6))]
        prompt = prompt[: max_model_length - 1]
        if batch and rng.random() < 0.15:
            prompt = list(rng.choice(batch).prompt)  # an exact duplicate: fully cached prompt
        # max_tokens within the context: more is refused (the library checks it as the server
        # does), so a sequence ends at the context's last token when it asks for all of it.
        max_tokens = rng.randint(1, min(14, max_model_length - len(prompt)))
        batch.append(Request(tuple(prompt), max_tokens, rng.random() < 0.5))
    return batch


def max_kv_blocks(req: Request, block_size: int, max_model_length: int) -> int:
    """Blocks the sequence can ever hold (request_checks.max_kv_tokens, rounded up to blocks)."""
    longest = min(len(req.prompt) + req.max_tokens, max_model_length)
    return -(-max(len(req.prompt), longest - 1) // block_size)


def run_engine(path: str, settings: dict[str, Any], calls: list[list[Request]],
               stats: dict[str, int]) -> list[list[dict[str, Any]]]:
    """All generate() calls on ONE engine; counts preemptions and prefix hits."""
    llm = LLM(path, eos=EOS, **settings)
    original_preempt = llm.scheduler.preempt

    def counting_preempt(seq: Any) -> None:
        stats["preemptions"] += 1
        original_preempt(seq)

    llm.scheduler.preempt = counting_preempt  # type: ignore[method-assign]
    results = []
    for batch in calls:
        outs = llm.generate([list(r.prompt) for r in batch], [r.params() for r in batch],
                            use_tqdm=False)
        for req, out in zip(batch, outs, strict=True):
            cached = out["num_cached_tokens"]
            assert cached % settings["block_size"] == 0 and 0 <= cached < len(req.prompt)
            if not settings["enable_prefix_caching"]:
                assert cached == 0
            stats["prefix_hits"] += cached > 0
            stats["early_stops"] += len(out["token_ids"]) < req.max_tokens
        results.append(outs)
        # Between calls nothing is queued and every block is free (cached or not).
        bm = llm.scheduler.block_manager
        assert not llm.scheduler.waiting and not llm.scheduler.running
        assert not used_block_ids(bm) and len(bm.free_block_ids) == len(bm.blocks)
        assert all(block.ref_count == 0 for block in bm.blocks)
    llm.exit()
    return results


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny matmuls run faster on one thread than on two contending ones (2-core CI)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# In the slow tests (~18 s a model here; the quick suite is at its 5-minute line): the
# scheduler's property tests (tests/core/test_scheduler_properties.py) keep random workloads
# in the quick ones.
@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_random_batches_match_one_at_a_time_generation(kind: str) -> None:
    path = str(tiny_checkpoint(kind))
    rng = random.Random(f"engine-random-{kind}")
    oracles: dict[int, Oracle] = {}
    stats = {"preemptions": 0, "prefix_hits": 0, "early_stops": 0}
    for trial in range(TRIALS):
        block_size = rng.choice([1, 2, 3, 4, 5, 8])
        max_model_length = rng.choice([20, 32, 48])
        prefixes = [[rng.randrange(1, VOCAB) for _ in range(rng.randint(4, 16))]
                    for _ in range(rng.randint(1, 3))]
        calls = [random_batch(rng, prefixes, max_model_length, rng.randint(1, 6))
                 for _ in range(rng.randint(2, 3))]
        requests = [r for batch in calls for r in batch]
        # The pool is barely larger than the largest single sequence needs: batches do not
        # fit, so the scheduler must queue, preempt and re-prefill.
        need = max(max_kv_blocks(r, block_size, max_model_length) for r in requests)
        settings = dict(
            block_size=block_size,
            num_kvcache_blocks=need + rng.randint(0, 3),
            max_num_sequences=rng.randint(1, 6),
            max_model_length=max_model_length,
            max_num_batched_tokens=max_model_length + rng.randint(0, 40),
        )
        oracle = oracles.setdefault(max_model_length, Oracle(path, max_model_length))
        expected = [[oracle(r) for r in batch] for batch in calls]
        # Chunked prefill runs with a budget below most prompts: they go in several chunks.
        chunk_budget = rng.randint(max(2, settings["max_num_sequences"]), 12)
        for caching, chunked in ((True, False), (False, False), (True, True), (False, True)):
            mode = {**settings, "enable_prefix_caching": caching,
                    "enable_chunked_prefill": chunked}
            if chunked:
                mode["max_num_batched_tokens"] = chunk_budget
            got = run_engine(path, mode, calls, stats)
            for batch, outs, want in zip(calls, got, expected, strict=True):
                for req, out, tokens in zip(batch, outs, want, strict=True):
                    assert out["token_ids"] == tokens, (
                        f"trial {trial} {mode}: {req} gave "
                        f"{out['token_ids']}, alone it gives {tokens}")
    # The workload must actually have exercised what it is about.
    if TRIALS >= 4:
        assert stats["preemptions"] > 0, stats
        assert stats["prefix_hits"] > 0, stats
        assert stats["early_stops"] > 0, stats  # eos before max_tokens
    print(kind, stats)
