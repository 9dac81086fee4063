"""On two GPUs: torch's symmetric-memory all-reduce (utils/symm_mem.py) sums what NCCL sums.

    the kernels     two-shot and one-shot against dist.all_reduce, bf16 and fp32, 1..256
                    rows x 4096, eager and replayed from a CUDA graph (new partials copied
                    into the captured input before each replay): equal, bit for bit (two
                    addends have one order)
    the engine      tensor_parallel_size 2, CUDA graphs on, fp32 (the Qwen3-0.6B shape,
                    random weights): the greedy tokens with the symmetric-memory all-reduce
                    equal those with disable_custom_all_reduce=True (NCCL only), and rank 0
                    really used it

Multicast stays off (TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NCCL_NVLS_ENABLE=0). Run with

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONPATH=src python3 -m pytest \\
        tests/gpu/test_gpu_all_reduce.py -q
"""

from __future__ import annotations

import os
import random
import socket
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")

ROWS = (1, 3, 16, 64, 256)


def kernels_on_rank(rank: int, port: int, failures: Any) -> None:
    import torch.distributed as dist

    from myvllm.utils.symm_mem import SymmMemAllReduce

    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, device_id=device)
    max_bytes = 256 * 4096 * 4
    kernels = {"two-shot": SymmMemAllReduce(device, max_bytes, one_shot_max_bytes=0),
               "one-shot": SymmMemAllReduce(device, max_bytes, one_shot_max_bytes=max_bytes)}
    found = []
    for dtype in (torch.bfloat16, torch.float32):
        for rows in ROWS:
            gen = torch.Generator(device=device).manual_seed(rows * 7 + rank)
            partials = [torch.randn(rows, 4096, device=device, dtype=dtype, generator=gen)
                        for _ in range(3)]
            for name, kernel in kernels.items():
                assert kernel.fits(partials[0])
                expected = [p.clone() for p in partials]
                for p in expected:
                    dist.all_reduce(p)
                got = kernel.all_reduce(partials[0].clone())
                if not torch.equal(got, expected[0]):
                    found.append(f"{name} eager {rows} rows {dtype}")
                # In a graph: capture on a static input, then replay on new partials.
                static = partials[0].clone()
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    kernel.all_reduce(static.clone())  # warm-up outside the capture
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    kernel.all_reduce(static)
                for p, e in zip(partials[1:], expected[1:]):
                    static.copy_(p)
                    graph.replay()
                    if not torch.equal(static, e):
                        found.append(f"{name} graph {rows} rows {dtype}")
                del graph
    torch.cuda.synchronize()
    failures.put((rank, found))
    dist.barrier()
    kernels.clear()
    dist.destroy_process_group()


def test_symmetric_memory_kernels_sum_as_nccl_does() -> None:
    import torch.multiprocessing as mp

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    failures = ctx.SimpleQueue()
    mp.start_processes(kernels_on_rank, args=(port, failures), nprocs=2, start_method="spawn")
    results = dict(failures.get() for _ in range(2))
    assert results == {0: [], 1: []}


@pytest.fixture(scope="module")
def checkpoint(qwen3_random_checkpoint: Path) -> Path:
    """Qwen3-0.6B's real shape with random weights: the session's (tests/gpu/conftest.py)."""
    return qwen3_random_checkpoint


def test_engine_tokens_with_symmetric_memory_equal_nccl_only(checkpoint: Path) -> None:
    from myvllm import LLM, SamplingParams
    from myvllm.utils import distributed

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    rng = random.Random(3)
    prompts = [[rng.randint(0, 150000) for _ in range(rng.randint(5, 200))] for _ in range(24)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs, kinds = [], []
    for disable in (True, False):
        llm = LLM(str(checkpoint), tensor_parallel_size=2, dtype="float32",
                  max_model_length=512, num_kvcache_blocks=1024, max_num_sequences=32,
                  disable_custom_all_reduce=disable)
        assert llm.model_runner.graphs.sizes("decode"), "decode CUDA graphs were not captured"
        kinds.append(distributed.all_reduce_kind())
        outs.append([o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)])
        llm.exit()
    assert kinds == ["nccl/gloo only", "symmetric memory"]
    for i, (nccl, symm) in enumerate(zip(*outs)):
        assert nccl == symm, f"prompt {i}: NCCL {nccl} != symmetric memory {symm}"
