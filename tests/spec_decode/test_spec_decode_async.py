"""Speculative decoding with async scheduling: a step whose rows verify proposals, or will
look them up next, is read back before the next step is planned; the steps of rows that
back off overlap. The tokens are those of plain decoding (greedy) and of the synchronous
engine (seeded sampling)."""

from __future__ import annotations


import pytest
from helpers_models import random_prompts, tiny_checkpoint
from helpers_overlap import overlapped, record_overlap

from myvllm import LLM, SamplingParams

COMMON = dict(block_size=4, max_model_length=128, num_kvcache_blocks=160)


@pytest.mark.slow
def test_async_speculation_keeps_the_tokens_and_overlaps_backed_off_steps() -> None:
    path = str(tiny_checkpoint("qwen3"))
    prompts = [[5, 6, 7, 8, 9, 10, 11] * 5, *random_prompts([23, 9], seed=7)]
    greedy = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    expected = [o["token_ids"] for o in LLM(path, **COMMON).generate(prompts, greedy,
                                                                     use_tqdm=False)]
    results = {}
    for mode in (False, True):
        llm = LLM(path, **COMMON, speculative_method="ngram", prompt_lookup_min=3,
                  async_scheduling=mode)
        calls = record_overlap(llm)
        got = [o["token_ids"] for o in llm.generate(prompts, greedy, use_tqdm=False)]
        assert got == expected
        speculator = llm.engine_core.scheduler.speculator
        assert speculator is not None and speculator.stats.num_accepted_tokens > 0
        assert overlapped(calls) == mode
        seeded = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, seed=5)
        results[mode] = [o["token_ids"] for o in llm.generate(prompts, seeded,
                                                              use_tqdm=False)]
        llm.exit()
    assert results[True] == results[False]


@pytest.mark.slow
def test_async_draft_speculation_keeps_the_tokens() -> None:
    """A draft model proposes at every decode step, so every step with proposals is read
    back before the next is planned: the tokens are plain decoding's (greedy, the target as
    its own draft: all accepted) and the synchronous engine's (seeded sampling)."""
    path = str(tiny_checkpoint("qwen3"))
    prompts = [[5, 6, 7, 8, 9, 10, 11] * 5, *random_prompts([23, 9], seed=7)]
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    expected = [o["token_ids"] for o in LLM(path, **COMMON, dtype="float32").generate(
        prompts, greedy, use_tqdm=False)]
    results = {}
    for mode in (False, True):
        llm = LLM(path, **COMMON, dtype="float32", speculative_method="draft",
                  speculative_model=path, async_scheduling=mode)
        got = [o["token_ids"] for o in llm.generate(prompts, greedy, use_tqdm=False)]
        assert got == expected
        speculator = llm.engine_core.scheduler.speculator
        assert speculator is not None
        assert speculator.stats.num_accepted_tokens == speculator.stats.num_draft_tokens > 0
        seeded = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, seed=5)
        results[mode] = [o["token_ids"] for o in llm.generate(prompts, seeded,
                                                              use_tqdm=False)]
        llm.exit()
    assert results[True] == results[False]
