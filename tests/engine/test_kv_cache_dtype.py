"""Config.kv_cache_dtype end to end on the CPU: the setting, the cache's size in blocks, and
greedy tokens of an fp8 cache against the model-dtype cache on the same weights.

The kernels themselves (quantize at store, dequantize at load) are tested in
tests/kernels/test_fp8_kv_cache.py; here the engine must pass the cache and the scales
through every kind of step: whole prompts, prompt chunks beside decode rows, prefix-cache hits.
"""

from __future__ import annotations

import pytest
import torch
from helpers_models import random_prompts, tiny_checkpoint

import myvllm.kernels.reference as reference
from myvllm import LLM, Config, SamplingParams
from myvllm.worker import kv_cache
from myvllm.worker.kv_cache import KVCacheLayout, count_blocks
from myvllm.layers.attention import Attention

MAX_TOKENS = 32
# Measured (CPU, one thread) over 8 prompts x 32 greedy tokens plus two prefix-cache hits,
# against the fp32 cache of the same engine settings: the tiny Qwen3 and the tiny Llama-3
# (random weights, tests/helpers_models.py) agree on 320/320 tokens with scales 1.0 and 1/8,
# the chosen tokens' logprobs within 0.0033 (Qwen3) and 0.107 (Llama-3) while the tokens
# agree; with the scales 1/8 dropped where the cache is read (a broken dequantize) 3% and 1%
# of the tokens agree.
MIN_AGREEMENT = 0.9
MAX_LOGPROB_ERROR = 0.25


def test_kv_cache_dtype_must_be_auto_or_fp8() -> None:
    assert Config().kv_cache_dtype == "auto"
    Config(kv_cache_dtype="fp8")
    for bad in ("fp16", "float8_e4m3fn", "FP8", None):
        with pytest.raises(ValueError, match=r"kv_cache_dtype=.*: allowed: 'auto', 'fp8'"):
            Config(kv_cache_dtype=bad)


def test_block_count_follows_bytes_per_element(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same memory holds twice the blocks of fp8 as of bf16 (four times fp32's)."""
    monkeypatch.setattr(kv_cache, "CPU_KV_CACHE_BYTES", 3 << 20)
    config = Config(max_num_sequences=1024)  # the byte budget decides, not the sequences

    def blocks(dtype: torch.dtype) -> int:
        layout = KVCacheLayout(num_layers=2, block_size=16, num_kv_heads=2, head_dim=16,
                               dtype=dtype)
        return count_blocks(config, layout, torch.device("cpu"), max_blocks_per_seq=64)

    assert blocks(torch.float8_e4m3fn) == 2 * blocks(torch.bfloat16) == 4 * blocks(torch.float32)
    assert blocks(torch.float8_e4m3fn) == (3 << 20) // (16 * 2 * 2 * 2 * 16)


class GreedyRun:
    """Greedy tokens and their logprobs from a fresh engine: one generate() call for the
    prompts, then a second one for two of them again (prefix-cache hits on their full blocks);
    steps of at most 24 tokens, so prompts go in chunks beside decode rows."""

    def __init__(self, path: str, prompts: list[list[int]], scales: float | None = None,
                 max_tokens: int = MAX_TOKENS, **settings: object) -> None:
        llm = LLM(path, block_size=4, max_model_length=128, max_num_batched_tokens=24,
                  **settings)
        if scales is not None:
            for module in llm.model_runner.model.modules():  # type: ignore[attr-defined]
                if isinstance(module, Attention):
                    module.k_scale = module.v_scale = scales
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                logprobs=0)
        outs = llm.generate(prompts, params, use_tqdm=False)
        again = llm.generate(prompts[:2], params, use_tqdm=False)
        assert all(out["num_cached_tokens"] > 0 for out in again)
        outs += again
        self.tokens = [out["token_ids"] for out in outs]
        self.logprobs = [[lp[t] for lp, t in zip(out["logprobs"], out["token_ids"])]
                         for out in outs]
        self.num_blocks = llm.config.num_kvcache_blocks
        self.cache_dtype = llm.model_runner.k_cache.dtype
        llm.exit()


def agreement(reference_tokens: list[list[int]], tokens: list[list[int]]) -> float:
    pairs = [(a, b) for x, y in zip(reference_tokens, tokens) for a, b in zip(x, y, strict=True)]
    return sum(a == b for a, b in pairs) / len(pairs)


def logprob_error(ref: GreedyRun, run: GreedyRun) -> float:
    """Largest |logprob difference| of the chosen tokens while the two runs agree."""
    errors = [0.0]
    for ref_tokens, ref_logprobs, tokens, logprobs in zip(ref.tokens, ref.logprobs, run.tokens,
                                                          run.logprobs):  # fmt: skip
        for a, b, la, lb in zip(ref_tokens, tokens, ref_logprobs, logprobs):
            if a != b:
                break
            errors.append(abs(la - lb))
    return max(errors)


def test_fp8_engine_allocates_fp8_blocks_and_agrees(monkeypatch: pytest.MonkeyPatch) -> None:
    """The quick version of the next test: two engines, a few short prompts."""
    path = str(tiny_checkpoint("qwen3"))
    monkeypatch.setattr(kv_cache, "CPU_KV_CACHE_BYTES", 4 << 20)  # the byte budget decides
    prompts = random_prompts([5, 17, 9])
    full = GreedyRun(path, prompts, max_tokens=8)
    fp8 = GreedyRun(path, prompts, max_tokens=8, kv_cache_dtype="fp8")
    assert fp8.cache_dtype == torch.float8_e4m3fn and full.cache_dtype == torch.float32
    assert fp8.num_blocks == 4 * full.num_blocks  # an fp32 model: 4 bytes per element -> 1
    assert agreement(full.tokens, fp8.tokens) >= MIN_AGREEMENT


@pytest.mark.slow  # four engines per model: tens of seconds on a busy 2-core CPU
@pytest.mark.parametrize("kind", ["qwen3", "llama3"])
def test_fp8_cache_greedy_agrees_with_the_full_cache(kind: str, monkeypatch: pytest.MonkeyPatch
                                                     ) -> None:  # fmt: skip
    path = str(tiny_checkpoint(kind))
    prompts = random_prompts([5, 11, 17, 30, 9, 40, 3, 22])
    monkeypatch.setattr(kv_cache, "CPU_KV_CACHE_BYTES", 4 << 20)  # the byte budget decides
    full = GreedyRun(path, prompts)
    fp8 = GreedyRun(path, prompts, kv_cache_dtype="fp8")
    assert agreement(full.tokens, fp8.tokens) >= MIN_AGREEMENT
    assert logprob_error(full, fp8) < MAX_LOGPROB_ERROR

    # Scales other than 1.0 reach the kernels: with 1/8 (a power of two, so the rounding is
    # the same) the tokens agree as well; with the scales dropped where the cache is read,
    # they do not.
    scaled = GreedyRun(path, prompts, scales=1 / 8, kv_cache_dtype="fp8")
    assert agreement(full.tokens, scaled.tokens) >= MIN_AGREEMENT
    monkeypatch.setattr(reference, "dequantize_kv", lambda stored, scale: stored.float())
    broken = GreedyRun(path, prompts, scales=1 / 8, kv_cache_dtype="fp8")
    assert agreement(full.tokens, broken.tokens) < 0.3


def test_batch_invariant_with_an_fp8_cache_is_refused() -> None:
    with pytest.raises(ValueError, match="batch_invariant=True does not combine with "
                                         "Config.kv_cache_dtype='fp8'.*allowed with it: "
                                         "Config.kv_cache_dtype='auto'"):
        Config(batch_invariant=True, kv_cache_dtype="fp8")
