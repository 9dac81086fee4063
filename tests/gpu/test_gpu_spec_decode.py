"""Speculative decoding on the GPU (skipped without CUDA): the paths a CPU never takes.

Run on a GPU machine with `PYTHONPATH=src python3 -m pytest tests/gpu/test_gpu_spec_decode.py -q`.

- verification rows (k + 1 tokens) in padded chunk steps, replayed from the chunk graphs,
  beside one-token rows (the decode kernel's) and prompt chunks; the LM head over every
  position of a verification row, the rejection sampler on the device, the emitted tokens
  copied back through pinned memory;
- greedy tokens equal to plain decoding (fp32), with and without CUDA graphs, through
  chunked prompts and preemption; seeded random rows repeat;
- with async scheduling (on by default): the greedy fast path (greedy_verify, the pool and
  the pinned copies), steps of backed-off rows overlapping with the device, and the
  synchronous engine's tokens for seeded sampling.
"""

from __future__ import annotations

import pytest
import torch
from helpers_models import random_prompts, tiny_checkpoint

from myvllm import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


def prompts() -> list[list[int]]:
    return [[5, 6, 7, 8, 9, 10, 11] * 6, *random_prompts([150, 9, 33], seed=5), [1, 2, 3] * 5]


@pytest.mark.parametrize("settings", [
    dict(),
    dict(enforce_eager=True),
    dict(max_num_batched_tokens=64),  # the 150-token prompt in chunks beside verification
    dict(num_kvcache_blocks=24, block_size=16),  # preemption
], ids=["graphs", "eager", "chunked", "preemption"])
def test_gpu_speculative_greedy_equals_plain(settings: dict[str, object]) -> None:
    path = str(tiny_checkpoint("qwen3"))
    common = dict(dtype="float32", max_model_length=256, **settings)
    plain = LLM(path, **common)
    expected = [o["token_ids"] for o in plain.generate(prompts(), GREEDY, use_tqdm=False)]
    del plain
    spec = LLM(path, **common, speculative_method="ngram", num_speculative_tokens=4)
    assert spec.config.async_scheduling is True  # on, read back where proposals need it
    got = [o["token_ids"] for o in spec.generate(prompts(), GREEDY, use_tqdm=False)]
    assert got == expected
    speculator = spec.engine_core.scheduler.speculator
    assert speculator is not None and speculator.stats.num_accepted_tokens > 0


def test_gpu_speculative_seeded_sampling_repeats() -> None:
    path = str(tiny_checkpoint("qwen3"))
    spec = LLM(path, dtype="float32", max_model_length=256, speculative_method="ngram",
               prompt_lookup_min=1)
    params = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=32, ignore_eos=True, seed=1)
    first = [o["token_ids"] for o in spec.generate(prompts(), params, use_tqdm=False)]
    again = [o["token_ids"] for o in spec.generate(prompts(), params, use_tqdm=False)]
    assert first == again


def test_gpu_async_speculation_takes_the_fast_path_and_keeps_the_tokens(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import myvllm.spec_decode.verification as verification

    path = str(tiny_checkpoint("qwen3"))
    common = dict(dtype="float32", max_model_length=256, num_kvcache_blocks=256)
    greedy = SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True)
    plain = LLM(path, **common)
    expected = [o["token_ids"] for o in plain.generate(prompts(), greedy, use_tqdm=False)]
    plain.exit()
    calls = [0]
    fast = verification.greedy_verify

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls[0] += 1
        return fast(*args, **kwargs)

    monkeypatch.setattr(verification, "greedy_verify", counted)
    seeded = SamplingParams(temperature=1.0, max_tokens=32, ignore_eos=True, seed=4)
    sampled = {}
    for mode in (True, False):
        spec = LLM(path, **common, speculative_method="ngram", num_speculative_tokens=4,
                   async_scheduling=mode)
        got = [o["token_ids"] for o in spec.generate(prompts(), greedy, use_tqdm=False)]
        assert got == expected and calls[0] > 0
        sampled[mode] = [o["token_ids"] for o in spec.generate(prompts(), seeded,
                                                               use_tqdm=False)]
        spec.exit()
    assert sampled[True] == sampled[False]


@pytest.mark.parametrize("settings", [
    dict(),
    dict(num_kvcache_blocks=24, block_size=16),  # preemption
], ids=["graphs", "preemption"])
def test_gpu_draft_model_greedy_equals_plain(settings: dict[str, object]) -> None:
    """The target's steps in CUDA graphs, the draft's eager beside them on its own cache
    (same blocks): the target as its own draft is accepted at every position (fp32), a
    different random draft is mostly rejected; the tokens equal plain decoding's."""
    import tempfile
    from pathlib import Path

    from helpers_models import build_tiny_checkpoint

    path = str(tiny_checkpoint("qwen3"))
    other = str(build_tiny_checkpoint("llama", Path(tempfile.mkdtemp()) / "draft", seed=5))
    # A fixed cache: an engine sized to the GPU's memory does not give it back on exit, and
    # three engines are built one after another here.
    common: dict[str, object] = {"dtype": "float32", "max_model_length": 256,
                                 "num_kvcache_blocks": 2048, **settings}
    plain = LLM(path, **common)
    expected = [o["token_ids"] for o in plain.generate(prompts(), GREEDY, use_tqdm=False)]
    plain.exit()
    for draft, all_accepted in ((path, True), (other, False)):
        spec = LLM(path, **common, speculative_method="draft", speculative_model=draft,
                   num_speculative_tokens=4)
        got = [o["token_ids"] for o in spec.generate(prompts(), GREEDY, use_tqdm=False)]
        assert got == expected
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
