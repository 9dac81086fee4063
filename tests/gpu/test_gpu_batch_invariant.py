"""Batch-invariant mode on the GPU (skipped without CUDA): bf16, the Qwen3-0.6B shape.

Run on a GPU machine with `PYTHONPATH=src python3 -m pytest tests/gpu/test_gpu_batch_invariant.py -q`.

The determinism runs of benchmarks/batch_invariance.py with Config.batch_invariant=True: 128
requests sharing a 512-token prefix run alone, inside a batch of 256, after a prefix-cache hit
and in chunks, and give the tokens and logprobs of the cold run, bit for bit (the default
mode does not: the script prints by how much). 32 greedy tokens each here, not the script's
128: every token's logprob is compared, and the suite fits one device call. Then the kernels
themselves in bf16, which the CPU interpreter cannot run: tests/kernels/test_batch_invariant.py
on the GPU.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_requests_agree_bit_for_bit_alone_batched_cached_and_chunked() -> None:
    from benchmarks.batch_invariance import run_scenarios

    rows = run_scenarios(batch_invariant=True, max_tokens=32)
    for row in rows:
        print(row)
    assert all(r.same_tokens_and_logprobs == r.requests for r in rows), rows
