"""Batch-invariant mode through the engine on a CPU.

What a CPU runs with batch_invariant=True: the torch references, with the matmuls padded to
a multiple of 8 rows (kernels.matmul_batch_invariant_ref; invariant on our CPUs by
measurement, see docs/reliability.md). The kernels' own invariance is
tests/kernels/test_batch_invariant.py; the bf16 GPU run is tests/gpu/test_gpu_batch_invariant.py.
"""

from __future__ import annotations

from typing import Any

import pytest
from helpers_models import random_prompts, tiny_checkpoint

from myvllm import LLM, SamplingParams
from myvllm.kernels import is_batch_invariant

PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=1)


def outputs(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], Any]]:
    return [(o["token_ids"], o["logprobs"]) for o in llm.generate(prompts, PARAMS,
                                                                   use_tqdm=False)]


@pytest.mark.slow
def test_requests_agree_alone_batched_cached_and_chunked() -> None:
    path = str(tiny_checkpoint("qwen3"))
    prefix = random_prompts([16], seed=3)[0]
    prompts = [prefix + tail for tail in random_prompts([3, 7, 5], seed=4)]
    fillers = random_prompts([9, 30, 2], seed=5)
    settings: dict[str, Any] = dict(block_size=4, max_model_length=96, batch_invariant=True)
    llm = LLM(path, enable_prefix_caching=False, **settings)
    assert is_batch_invariant()
    cold = outputs(llm, prompts)
    assert [outputs(llm, [p])[0] for p in prompts] == cold
    mixed = outputs(llm, [fillers[0], prompts[0], fillers[1], prompts[1], prompts[2],
                          fillers[2]])
    assert [mixed[1], mixed[3], mixed[4]] == cold
    cached = LLM(path, **settings)
    cached.generate([prefix], PARAMS, use_tqdm=False)
    hit = cached.generate(prompts, PARAMS, use_tqdm=False)
    assert all(o["num_cached_tokens"] == 16 for o in hit)
    assert [(o["token_ids"], o["logprobs"]) for o in hit] == cold
    chunked = LLM(path, enable_prefix_caching=False, max_num_batched_tokens=8, **settings)
    assert outputs(chunked, prompts) == cold
    # The next engine of this process runs in its own mode.
    LLM(path, block_size=4, max_model_length=96).generate([prefix], PARAMS, use_tqdm=False)
    assert not is_batch_invariant()


def test_mixture_of_experts_is_refused_before_any_work() -> None:
    with pytest.raises(ValueError, match=r"Config.batch_invariant=True with a mixture-of-experts "
                                         r"model \(.*\): allowed: batch_invariant=False"):
        LLM(str(tiny_checkpoint("qwen3_moe")), batch_invariant=True)


@pytest.mark.slow
def test_tensor_parallel_rows_agree_alone_batched_and_chunked() -> None:
    """tensor_parallel_size=2 over gloo: the row-parallel layers' sum is an all-gather and an
    add in rank order (utils/distributed.py, all_reduce(in_rank_order=True)); a request alone, in a
    batch and in chunks gets the same tokens and logprobs, and the tokens of one rank."""
    path = str(tiny_checkpoint("qwen3"))
    prompts = random_prompts([11, 6, 19], seed=8)
    settings: dict[str, Any] = dict(block_size=4, max_model_length=64, batch_invariant=True,
                                    enable_prefix_caching=False)
    single = outputs(LLM(path, **settings), prompts)
    llm = LLM(path, tensor_parallel_size=2, **settings)
    batched = outputs(llm, prompts)
    assert [outputs(llm, [p])[0] for p in prompts] == batched
    llm.exit()
    chunked = LLM(path, tensor_parallel_size=2, max_num_batched_tokens=8, **settings)
    assert outputs(chunked, prompts) == batched
    chunked.exit()
    assert [tokens for tokens, _ in batched] == [tokens for tokens, _ in single]
