"""Speculative decoding on the GPU (skipped without CUDA): the paths a CPU never takes.

Run on a GPU machine with `PYTHONPATH=src python3 -m pytest tests/gpu/test_gpu_spec_decode.py -q`.

- verification rows (k + 1 tokens) as decode rows replayed from the decode graphs, and in
  padded chunk steps beside prompt chunks; the LM head over every position of a verification
  row, the rejection sampler on the device, the emitted tokens copied back through pinned
  memory;
- n-gram speculation's greedy tokens equal plain decoding's (fp32), with CUDA graphs, eager,
  through chunked prompts and through preemption; seeded random rows repeat;
- with async scheduling (on by default): the greedy fast path (greedy_verify, the pool and
  the pinned copies), steps of backed-off rows overlapping with the device, and the
  synchronous engine's tokens for seeded sampling;
- a draft model (the target itself: every proposal accepted; another random model: mostly
  rejected) with the target's steps in CUDA graphs, through preemption: plain decoding's
  greedy tokens, and seeded sampling that repeats.

All on the tiny random Qwen3 in fp32 with a fixed KV cache (tests/gpu/conftest.py says why);
plain decoding with the default settings runs once for the file (plain_96).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers_models import random_prompts, tiny_checkpoint

from myvllm import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# fp32, and a cache of 256 blocks of 16 (the 5 prompts need ~60): settings override it.
COMMON: dict[str, Any] = dict(dtype="float32", max_model_length=256, num_kvcache_blocks=256)


def prompts() -> list[list[int]]:
    return [[5, 6, 7, 8, 9, 10, 11] * 6, *random_prompts([150, 9, 33], seed=5), [1, 2, 3] * 5]


def greedy_tokens(llm: LLM, max_tokens: int = 40) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [o["token_ids"] for o in llm.generate(prompts(), params, use_tqdm=False)]


@pytest.fixture(scope="module")
def plain_96() -> list[list[int]]:
    """Plain decoding's greedy tokens with COMMON's settings, 96 a prompt (all five run
    together to the end, so the first 40 are those of a 40-token run)."""
    plain = LLM(str(tiny_checkpoint("qwen3")), **COMMON)
    tokens = greedy_tokens(plain, 96)
    plain.exit()
    return tokens


def plain_greedy(settings: dict[str, object], plain_96: list[list[int]]) -> list[list[int]]:
    """Plain decoding's 40 greedy tokens with these settings (the shared run for none)."""
    if not settings:
        return [t[:40] for t in plain_96]
    plain = LLM(str(tiny_checkpoint("qwen3")), **{**COMMON, **settings})
    tokens = greedy_tokens(plain)
    plain.exit()
    return tokens


@pytest.mark.parametrize("settings", [
    dict(),
    dict(enforce_eager=True),
    dict(max_num_batched_tokens=64),  # the 150-token prompt in chunks beside verification
    dict(num_kvcache_blocks=24, block_size=16),  # preemption
], ids=["graphs", "eager", "chunked", "preemption"])
def test_gpu_speculative_greedy_equals_plain(settings: dict[str, object],
                                             plain_96: list[list[int]]) -> None:
    expected = plain_greedy(settings, plain_96)
    spec = LLM(str(tiny_checkpoint("qwen3")), **{**COMMON, **settings},
               speculative_method="ngram", num_speculative_tokens=4)
    assert spec.config.async_scheduling is True  # on, read back where proposals need it
    assert greedy_tokens(spec) == expected
    speculator = spec.engine_core.scheduler.speculator
    assert speculator is not None and speculator.stats.num_accepted_tokens > 0
    spec.exit()


def test_gpu_speculative_seeded_sampling_repeats() -> None:
    spec = LLM(str(tiny_checkpoint("qwen3")), **COMMON, speculative_method="ngram",
               prompt_lookup_min=1)
    params = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=32, ignore_eos=True, seed=1)
    first = [o["token_ids"] for o in spec.generate(prompts(), params, use_tqdm=False)]
    again = [o["token_ids"] for o in spec.generate(prompts(), params, use_tqdm=False)]
    assert first == again
    spec.exit()


def test_gpu_async_speculation_takes_the_fast_path_and_keeps_the_tokens(
        monkeypatch: pytest.MonkeyPatch, plain_96: list[list[int]]) -> None:
    import myvllm.spec_decode.verification as verification

    path = str(tiny_checkpoint("qwen3"))
    calls = [0]
    fast = verification.greedy_verify

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls[0] += 1
        return fast(*args, **kwargs)

    monkeypatch.setattr(verification, "greedy_verify", counted)
    seeded = SamplingParams(temperature=1.0, max_tokens=32, ignore_eos=True, seed=4)
    sampled = {}
    for mode in (True, False):
        spec = LLM(path, **COMMON, speculative_method="ngram", num_speculative_tokens=4,
                   async_scheduling=mode)
        assert greedy_tokens(spec, 96) == plain_96 and calls[0] > 0
        sampled[mode] = [o["token_ids"] for o in spec.generate(prompts(), seeded,
                                                               use_tqdm=False)]
        spec.exit()
    assert sampled[True] == sampled[False]


@pytest.mark.parametrize("settings", [
    dict(),
    dict(num_kvcache_blocks=24, block_size=16),  # preemption
], ids=["graphs", "preemption"])
def test_gpu_draft_model_greedy_equals_plain(settings: dict[str, object],
                                            plain_96: list[list[int]]) -> None:
    """The target's steps in CUDA graphs, the draft's beside them on its own cache (same
    blocks): the target as its own draft is accepted at every position (fp32), a different
    random draft is mostly rejected; the tokens equal plain decoding's."""
    import tempfile
    from pathlib import Path

    from helpers_models import build_tiny_checkpoint

    path = str(tiny_checkpoint("qwen3"))
    other = str(build_tiny_checkpoint("llama", Path(tempfile.mkdtemp()) / "draft", seed=5))
    expected = plain_greedy(settings, plain_96)
    # A fixed cache (each draft block sits beside the target's): the two speculative engines
    # are built one after another.
    common = {**COMMON, "num_kvcache_blocks": 2048, **settings}
    for draft, all_accepted in ((path, True), (other, False)):
        spec = LLM(path, **common, speculative_method="draft", speculative_model=draft,
                   num_speculative_tokens=4)
        assert greedy_tokens(spec) == expected
        speculator = spec.engine_core.scheduler.speculator
        assert speculator is not None and speculator.stats.num_drafts > 0
        stats = speculator.stats
        assert (stats.num_accepted_tokens == stats.num_draft_tokens) == all_accepted
        sampled = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=32, ignore_eos=True,
                                 seed=1)
        first = [o["token_ids"] for o in spec.generate(prompts(), sampled, use_tqdm=False)]
        assert [o["token_ids"] for o in spec.generate(prompts(), sampled,
                                                      use_tqdm=False)] == first
        spec.exit()
