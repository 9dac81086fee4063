"""Sampling controls on the GPU (skipped without CUDA), against the CPU reference path.

Run on a GPU machine with
`PYTHONPATH=src python3 -m pytest tests/gpu/test_gpu_sampling_controls.py -q`.

- a mixed batch, rows with penalties, a logit bias, min_tokens and min_p beside rows that ask
  for nothing, through the GPU engine (CUDA graphs, async scheduling, chunked prompts): a
  decode step with a controlled row leaves the graph's in-graph sampling, reads the pending
  tokens from the pool before the graph overwrites it, and processes the logits eagerly. Its
  greedy tokens equal the same requests on the CPU engine, and the plain rows' tokens equal
  a run without the controlled rows (the graph's path);
- the processed logits on the GPU equal the CPU's for the same sequences.
"""

from __future__ import annotations

import pytest
import torch
from helpers_models import random_prompts, tiny_checkpoint

from myvllm import LLM, SamplingParams
from myvllm.sample.sampling_controls import prepare_logits_processing
from myvllm.engine.sequence import Sequence
from myvllm.worker.staging import FreshTensors
from myvllm.layers.logits_processors import process_logits
from myvllm.worker.pending_tokens import add_pending_token

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

GREEDY = dict(temperature=0.0, max_tokens=16)
CONTROLS = [dict(repetition_penalty=3.0), dict(presence_penalty=2.0, frequency_penalty=2.0),
            dict(logit_bias={65: 100.0}, min_tokens=4, stop_token_ids=[65]),
            dict(min_tokens=10, logit_bias={0: 100.0}), dict(min_p=0.5, temperature=0.0), {}, {}]


def test_mixed_batch_on_the_gpu_equals_the_cpu_reference() -> None:
    path = str(tiny_checkpoint("qwen3"))
    prompts = random_prompts([40, 9, 5, 12, 7, 20, 3], seed=21)
    params = [SamplingParams(**{**GREEDY, **c}) for c in CONTROLS]
    # A fixed cache (tests/gpu/conftest.py: not millions of tiny blocks).
    settings = dict(dtype="float32", max_model_length=256, max_num_batched_tokens=32,
                    num_kvcache_blocks=256)
    gpu = LLM(path, async_scheduling=True, **settings)  # pending tokens read from the pool
    on_gpu = gpu.generate(prompts, params, use_tqdm=False)
    plain = gpu.generate(prompts[5:], params[5:], use_tqdm=False)
    gpu.exit()
    cpu = LLM(path, device="cpu", **settings)
    on_cpu = cpu.generate(prompts, params, use_tqdm=False)
    assert [o["token_ids"] for o in on_gpu] == [o["token_ids"] for o in on_cpu]
    assert [o["token_ids"] for o in on_gpu[5:]] == [o["token_ids"] for o in plain]
    assert on_gpu[2]["token_ids"][-1] == 65 and len(on_gpu[2]["token_ids"]) == 5
    assert len(on_gpu[3]["token_ids"]) == 11 and on_gpu[3]["token_ids"][-1] == 0


def test_processed_logits_on_the_gpu_equal_the_cpus() -> None:
    gen = torch.Generator().manual_seed(0)
    vocab = 1000
    seqs = []
    for i, c in enumerate(CONTROLS):
        seq = Sequence(torch.randint(1, vocab, (30,), generator=gen).tolist(), 16,
                       SamplingParams(**{**GREEDY, **c}))
        for token in torch.randint(1, vocab, (i,), generator=gen).tolist():
            seq.append_token(token)
        add_pending_token(seq)  # its newest token still in the pool (async scheduling)
        seq.sampled_row = i
        seqs.append(seq)
    pool = torch.randint(1, vocab, (len(seqs),), generator=gen)
    logits = torch.randn(len(seqs), vocab, generator=gen) * 3
    results = []
    for device in (torch.device("cuda"), torch.device("cpu")):
        for seq in seqs:  # the two plain rows ({}) have no extras
            if seq.extras is not None:
                seq.extras.penalty_prompt_ids = None  # made again on this device
        processing = prepare_logits_processing(seqs, FreshTensors(device).tensor,
                                               pool.to(device), frozenset({0}))
        assert processing is not None
        results.append(process_logits(logits.to(device), processing).cpu())
    torch.testing.assert_close(results[0], results[1])
    assert not torch.equal(results[1], logits)
