"""Over NCCL on two GPUs: async scheduling under tensor parallelism gives, token for token, the
tokens of the plain loop (async_scheduling=False) at the same tensor-parallel size.

Under async scheduling rank 0 queues step N+1 before step N's tokens reach the host; the
workers read each pending token from their own sampled-token pool, which rank 0 fills with a
broadcast at the end of every step (ModelRunner.run). Checked on the Qwen3-0.6B shape with CUDA
graphs, whole prompts (decode graphs that captured NCCL all-reduces) and chunks of a 256-token
budget (mixed steps on the chunked-prefill graphs, where pending decode rows sit beside prompt
chunks), with eos stops and seeded sampling. (It passed on two H200s, and async scheduling is
now on by default under tensor parallelism too.) Run with

    NCCL_NVLS_ENABLE=0 PYTHONPATH=src python3 -m pytest tests/gpu/test_gpu_tp_async.py -q
"""

from __future__ import annotations

import os
import random
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")

# fp32: async scheduling may put a sequence that just stopped on eos into one more step (its
# surplus token is dropped), so a step can hold other rows than under the plain loop. Each
# row's numbers then come from kernels picked for another batch size; in fp32 that rounding is
# far below any logit gap of the random model, so the tokens must be identical.
ENGINE_ARGS: dict[str, Any] = dict(max_model_length=1024, num_kvcache_blocks=4096,
                                   max_num_sequences=64, dtype="float32",
                                   tensor_parallel_size=2)


@pytest.fixture(scope="module")
def checkpoint(qwen3_random_checkpoint: Path) -> Path:
    """Qwen3-0.6B's real shape with random weights: the session's (tests/gpu/conftest.py)."""
    return qwen3_random_checkpoint


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(13)
    return [[rng.randint(0, 150000) for _ in range(rng.randint(5, 300))] for _ in range(48)]


_rng = random.Random(17)
MAX_TOKENS = [_rng.randint(1, 40) for _ in range(48)]


@pytest.fixture(scope="module")
def eos(checkpoint: Path, prompts: list[list[int]]) -> int:
    """A token the model emits often: as eos, it stops some sequences early."""
    from myvllm import LLM, SamplingParams

    llm = LLM(str(checkpoint), eos=-1, async_scheduling=False, **ENGINE_ARGS)
    probe = llm.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=n)
                                   for n in MAX_TOKENS], use_tqdm=False)
    llm.exit()
    return Counter(t for o in probe for t in o["token_ids"][1:]).most_common(1)[0][0]


@pytest.mark.parametrize("budget", [8192, 256], ids=["whole_prompts", "chunks_of_256"])
def test_tp2_async_equals_tp2_sync(checkpoint: Path, prompts: list[list[int]], eos: int,
                                   budget: int) -> None:
    from myvllm import LLM, SamplingParams

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    # Greedy rows, then seeded rows through the full sampler (top-p) and temperature only.
    params = [SamplingParams(temperature=0.0, max_tokens=n) for n in MAX_TOKENS[:32]]
    params += [SamplingParams(temperature=0.8, top_p=0.9 if i % 2 else 1.0, seed=i, max_tokens=n)
               for i, n in enumerate(MAX_TOKENS[32:])]
    outs = []
    pending_rows: list[tuple[bool, int]] = []
    for async_scheduling in (False, True):
        llm = LLM(str(checkpoint), eos=eos, async_scheduling=async_scheduling,
                  max_num_batched_tokens=budget, **ENGINE_ARGS)
        assert llm.async_scheduling == async_scheduling
        assert llm.model_runner.graphs.sizes("decode"), "decode CUDA graphs were not captured"
        if llm.async_scheduling:
            run = llm.model_runner.run

            def recording_run(seqs: Any, is_prefill: bool, run: Any = run) -> Any:
                pending_rows.append((is_prefill, sum(s.num_pending_tokens > 0 for s in seqs)))
                return run(seqs, is_prefill)

            llm.model_runner.run = recording_run  # type: ignore[method-assign]
        outs.append([o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)])
        llm.exit()
    sync, overlapped = outs
    for i, (a, b) in enumerate(zip(sync, overlapped)):
        assert a == b, f"sequence {i} ({params[i]}): sync {a} != async {b}"
    assert any(len(o) < n for o, n in zip(sync[:32], MAX_TOKENS)), "no sequence stopped on eos"
    # The workers read pending tokens from their pools: in decode steps, and with the small
    # budget in mixed steps too.
    assert any(pending for _, pending in pending_rows)
    if budget == 256:
        assert any(is_prefill and pending for is_prefill, pending in pending_rows)
