"""n > 1 completions on the GPU (skipped without CUDA): forks through CUDA graphs.

Run on a GPU machine with `PYTHONPATH=src python3 -m pytest tests/gpu/test_gpu_n_completions.py -q`.

The forks' decode rows run in the decode graphs and their shared-prefix prefills in padded
chunk steps, paths a CPU never takes. Greedy completions must each be the n = 1 completion
(async scheduling and chunked prefill on, the defaults), the prompt's full blocks prefilled
once, seeded completions reproducible, and no block held at the end.
"""

from __future__ import annotations

import pytest
import torch
from helpers_blocks import used_block_ids
from helpers_models import random_prompts, tiny_checkpoint

from myvllm import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("chunked", [True, False])
def test_gpu_greedy_forks_equal_n1(dtype: str, chunked: bool) -> None:
    # Chunked: a budget of 64, so the 150-token prompt runs in padded chunk steps.
    # A fixed cache: several engines run in this process, and one sized to the GPU's memory
    # can find none left (on the H200 an exited engine's memory was not back in time).
    llm = LLM(str(tiny_checkpoint("llama")), dtype=dtype, max_model_length=256,
              num_kvcache_blocks=512, enable_chunked_prefill=chunked, max_num_batched_tokens=64 if chunked else 1024,
              enable_prefix_caching=False)
    prompts = random_prompts([150, 9, 33], seed=7)
    greedy = dict(temperature=0.0, max_tokens=24, ignore_eos=True)
    want = llm.generate(prompts, SamplingParams(**greedy), use_tqdm=False)
    counted = []
    step = llm.engine_core.step

    def counting_step():  # type: ignore[no-untyped-def]
        outputs, num_tokens = step()
        counted.append(num_tokens)
        return outputs, num_tokens

    llm.engine_core.step = counting_step  # type: ignore[method-assign]
    outs = llm.generate(prompts, SamplingParams(**greedy, n=4), use_tqdm=False)
    for out, single in zip(outs, want, strict=True):
        assert [c["token_ids"] for c in out["outputs"]] == [single["token_ids"]] * 4
    assert not used_block_ids(llm.scheduler.block_manager)
    if not chunked:  # prefill steps compute prompt tokens only
        # Each prompt once, and each of the 3 forks the tokens after the shared full blocks.
        block = llm.config.block_size
        forked = sum(len(p) - (len(p) - 1) // block * block for p in prompts)
        assert sum(c for c in counted if c > 0) == sum(map(len, prompts)) + 3 * forked
    llm.exit()


def test_gpu_seeded_forks_are_reproducible() -> None:
    llm = LLM(str(tiny_checkpoint("llama")), max_model_length=256, num_kvcache_blocks=512)
    prompts = random_prompts([40, 70], seed=8)
    params = SamplingParams(temperature=1.0, max_tokens=32, ignore_eos=True, seed=3, n=3)
    first = llm.generate(prompts, params, use_tqdm=False)
    again = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(first, again, strict=True):
        assert [c["token_ids"] for c in a["outputs"]] == [c["token_ids"] for c in b["outputs"]]
        assert len({tuple(c["token_ids"]) for c in a["outputs"]}) > 1
    llm.exit()
