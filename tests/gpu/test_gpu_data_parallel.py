"""Data-parallel replicas on GPUs (DPAsyncLLM): each replica's core process sees only its own
GPU, the replicas give one engine's greedy tokens, and more replicas than GPUs is refused
before anything starts. Run with

    PYTHONPATH=src python3 -m pytest tests/gpu/test_gpu_data_parallel.py -q

(the refusal needs one GPU; the two replicas need two, and are skipped on one).
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
import torch

from myvllm import LLM, Config, SamplingParams
from myvllm.serving.dp_async_llm import DPAsyncLLM, replica_devices

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

REPO = Path(__file__).resolve().parents[2]
# fp32: the replicas' batches differ from the reference's, and in fp32 the rounding of other
# batch sizes' kernels is far below any logit gap of the random model.
ENGINE_ARGS = dict(max_model_length=1024, num_kvcache_blocks=2048, max_num_sequences=64,
                   dtype="float32")


def test_more_replicas_than_gpus_is_refused() -> None:
    """Refused before anything starts or loads: a folder with config.json alone will do."""
    count = torch.cuda.device_count()
    with pytest.raises(ValueError, match=f"= {count + 1} GPUs: allowed: at most the {count} "
                                         "visible"):
        DPAsyncLLM(Config(model=str(REPO / "configs" / "Qwen3-0.6B"), load_format="dummy",
                          data_parallel_size=count + 1, **ENGINE_ARGS))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_two_replicas_each_on_its_gpu_give_one_engines_tokens(
        qwen3_random_checkpoint: Path) -> None:
    checkpoint = qwen3_random_checkpoint
    rng = random.Random(5)
    prompts = [[rng.randint(0, 150000) for _ in range(rng.randint(5, 300))] for _ in range(32)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    reference = LLM(Config(model=str(checkpoint), **ENGINE_ARGS))
    try:
        expected = [o["token_ids"] for o in reference.generate(prompts, params, use_tqdm=False)]
    finally:
        reference.exit()

    config = Config(model=str(checkpoint), data_parallel_size=2, **ENGINE_ARGS)
    devices = replica_devices(config)  # "0" and "1", unless CUDA_VISIBLE_DEVICES says others
    assert len(set(devices)) == 2
    llm = DPAsyncLLM(config)
    try:
        for pid, device in zip(llm.core_pids, devices):
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            assert f"CUDA_VISIBLE_DEVICES={device}".encode() in environ

        async def run() -> list[list[int]]:
            async def one(i: int, prompt: list[int]) -> list[int]:
                ids: list[int] = []
                async for out in llm.generate(prompt, params, f"r{i}"):
                    ids += out.token_ids
                return ids

            return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))

        loop = asyncio.new_event_loop()
        try:
            got = loop.run_until_complete(run())
        finally:
            llm.shutdown()
            loop.close()
        assert min(llm.router.num_routed) >= 8, llm.router.num_routed  # both served
        assert got == expected
    finally:
        llm.shutdown()
