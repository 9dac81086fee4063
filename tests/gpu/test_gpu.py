"""GPU checks of the core path (skipped without CUDA: CI has no GPU).

Run on a GPU machine with `PYTHONPATH=src python3 -m pytest tests/gpu/test_gpu.py -q`.
What passed there, with date, GPU and versions, is recorded in docs/benchmarks.md.

- the decode and prefill kernels in bf16 against the PyTorch references at Qwen3-0.6B's
  shapes (16 query heads, 8 KV heads, head_dim 128), block sizes 16 and 256, contexts to 8k,
  the prefill kernel with and without a 1,024-token cached prefix read through block tables;
- the model at Qwen3-0.6B's real shape (random weights: the session's checkpoint,
  tests/gpu/conftest.py) against transformers' Qwen3ForCausalLM;
- two engines of that shape, built once for the file (eager with the synchronous loop; CUDA
  graphs with async scheduling): greedy tokens of the graph engine equal the eager engine's
  at batch sizes 1, 3, 17 and 64 (padded to the captured 1, 4, 32 and 64), the first decode
  step replaying the smallest graph that fits; sampling in the graph (temperature only) is
  reproducible under a seed and not the argmax, and seeded top-p outside it equals eager;
- async scheduling gives the synchronous loop's tokens with CUDA graphs, 64 sequences
  stopping at different steps on eos and max_tokens;
- a prefix-cache hit gives the cold tokens (the tiny random Qwen3, fp32);
- chunked prefill under a 256-token budget (chunk graphs, mixed steps, async) gives the
  eager engine's tokens, and prefill-first's first tokens;
- on two GPUs, tensor parallelism over NCCL gives one GPU's tokens (skipped on one).
"""
from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("seq_lens", [[8192], [1, 777, 4096, 2500]])
def test_decode_kernel_bf16_real_shapes(block_size: int, seq_lens: list[int]) -> None:
    from myvllm.kernels import paged_attention_decode, paged_attention_decode_ref

    torch.manual_seed(0)
    hq, hkv, d = 16, 8, 128
    batch = len(seq_lens)
    max_blocks = max(-(-n // block_size) for n in seq_lens)
    num_blocks = batch * max_blocks + 3
    k_cache = torch.randn(num_blocks, block_size, hkv, d, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    perm = torch.randperm(num_blocks, device="cuda")[: batch * max_blocks].int()
    block_tables = perm.view(batch, max_blocks).clone()
    for b, n in enumerate(seq_lens):
        block_tables[b, -(-n // block_size):] = -1
    context_lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, hq, d, device="cuda", dtype=torch.bfloat16)
    out = paged_attention_decode(q, k_cache, v_cache, block_tables, context_lens, d ** -0.5)
    ref = paged_attention_decode_ref(q.float(), k_cache.float(), v_cache.float(), block_tables,
                                     context_lens, d ** -0.5)
    assert rel_err(out, ref) < 2e-2


@pytest.mark.parametrize("cached", [0, 1024])
@pytest.mark.parametrize("block_size", [16, 256])
def test_prefill_kernel_bf16_real_shapes(cached: int, block_size: int) -> None:
    from myvllm.kernels import (
        flash_attention_varlen,
        flash_attention_varlen_ref,
        store_kvcache,
    )

    torch.manual_seed(0)
    hq, hkv, d = 16, 8, 128
    new_lens = [8192 - cached, 300, 1]
    ctx_lens = [n + cached for n in new_lens]
    cu_q = torch.tensor([0] + list(torch.tensor(new_lens).cumsum(0)), dtype=torch.int32,
                        device="cuda")
    cu_k = torch.tensor([0] + list(torch.tensor(ctx_lens).cumsum(0)), dtype=torch.int32,
                        device="cuda")
    total_q = sum(new_lens)
    q = torch.randn(total_q, hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(total_q, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    scale = d ** -0.5
    if cached == 0:
        out = flash_attention_varlen(q, k, v, cu_q, cu_q, max(new_lens), max(new_lens), scale)
        ref = flash_attention_varlen_ref(q.float(), k.float(), v.float(), cu_q, cu_q,
                                         max(new_lens), max(new_lens), scale)
    else:
        max_blocks = max(-(-n // block_size) for n in ctx_lens)
        num_blocks = len(ctx_lens) * max_blocks
        k_cache = torch.randn(num_blocks, block_size, hkv, d, device="cuda",
                              dtype=torch.bfloat16)
        v_cache = torch.randn_like(k_cache)
        tables = torch.randperm(num_blocks, device="cuda").int().view(len(ctx_lens), max_blocks)
        slots = []
        for b, (n_new, n_ctx) in enumerate(zip(new_lens, ctx_lens)):
            for p in range(n_ctx - n_new, n_ctx):
                slots.append(tables[b, p // block_size].item() * block_size + p % block_size)
        store_kvcache(k, v, k_cache, v_cache, torch.tensor(slots, dtype=torch.int32,
                                                             device="cuda"))
        out = flash_attention_varlen(q, k, v, cu_q, cu_k, max(new_lens), max(ctx_lens), scale,
                                     tables, k_cache, v_cache)
        ref = flash_attention_varlen_ref(q.float(), k.float(), v.float(), cu_q, cu_k,
                                         max(new_lens), max(ctx_lens), scale, tables,
                                         k_cache.float(), v_cache.float())
    assert rel_err(out, ref) < 2e-2


def test_qwen3_06b_logits_match_transformers(qwen3_random_checkpoint: Path) -> None:
    from helpers_models import assert_prefill_logits_match_transformers
    from transformers import AutoModelForCausalLM

    path = qwen3_random_checkpoint
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    assert_prefill_logits_match_transformers(path, hf)

ENGINE_ARGS = dict(max_model_length=1024, max_num_batched_tokens=8192, num_kvcache_blocks=4096,
                   max_num_sequences=64)
GREEDY_24 = dict(temperature=0.0, max_tokens=24, ignore_eos=True)


def run_greedy(path: Path, prompts: list[list[int]], **kwargs) -> list:
    from myvllm import LLM, SamplingParams

    llm = LLM(str(path), **{**ENGINE_ARGS, **kwargs})
    outs = llm.generate(prompts, SamplingParams(**GREEDY_24), use_tqdm=False)
    llm.exit()
    return outs


@pytest.fixture(scope="module")
def eager_and_graph_engines(qwen3_random_checkpoint: Path):
    from myvllm import LLM

    # The graph engine overlaps host and device (async scheduling, the default on a GPU);
    # the eager one reads every step's tokens before planning the next: the plainest path.
    eager = LLM(str(qwen3_random_checkpoint), enforce_eager=True, async_scheduling=False,
                **ENGINE_ARGS)
    graph = LLM(str(qwen3_random_checkpoint), enforce_eager=False, **ENGINE_ARGS)
    assert graph.model_runner.graphs.sizes("decode") == [1, 2, 4, 8, 16, 32, 48, 64]
    assert graph.async_scheduling and not eager.async_scheduling
    yield eager, graph
    eager.exit()
    graph.exit()


@pytest.mark.parametrize("batch_size", [1, 3, 17, 64])
def test_cuda_graph_tokens_equal_eager(eager_and_graph_engines, batch_size: int) -> None:
    from myvllm import SamplingParams

    eager, graph = eager_and_graph_engines
    rng = random.Random(batch_size)
    prompts = [[rng.randint(0, 150000) for _ in range(rng.randint(5, 300))]
               for _ in range(batch_size)]
    params = SamplingParams(**GREEDY_24)
    replays = []
    graphs = graph.model_runner.graphs
    original = graphs.replay
    graphs.replay = lambda key: (key[0] == "decode" and replays.append(key[1])) or original(key)
    try:
        graph_out = graph.generate(prompts, params, use_tqdm=False)
    finally:
        graphs.replay = original  # type: ignore[method-assign]
    # The first decode step has every sequence: it replays the smallest graph that fits.
    expected = next(bs for bs in graphs.sizes("decode") if bs >= batch_size)
    assert replays and replays[0] == expected, f"replayed {replays[:3]}, expected {expected}"
    eager_out = eager.generate(prompts, params, use_tqdm=False)
    assert [o["token_ids"] for o in graph_out] == [o["token_ids"] for o in eager_out]


def test_async_scheduling_gives_sync_tokens_with_eos_and_mixed_lengths(
        eager_and_graph_engines, qwen3_random_checkpoint: Path) -> None:
    """CUDA graphs with and without async scheduling, 64 sequences that stop at different
    steps (max_tokens, and eos = a token the model emits often)."""
    from collections import Counter

    from myvllm import LLM, SamplingParams

    _, graph = eager_and_graph_engines
    rng = random.Random(11)
    prompts = [[rng.randint(0, 150000) for _ in range(rng.randint(5, 200))] for _ in range(64)]
    lengths = [rng.randint(1, 40) for _ in prompts]
    probe = graph.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=n,
                                                    ignore_eos=True) for n in lengths],
                           use_tqdm=False)
    eos = Counter(t for o in probe for t in o["token_ids"][1:]).most_common(1)[0][0]
    params = [SamplingParams(temperature=0.0, max_tokens=n) for n in lengths]
    outs = []
    for async_scheduling in (False, True):
        llm = LLM(str(qwen3_random_checkpoint), eos=eos, async_scheduling=async_scheduling,
                  **ENGINE_ARGS)
        outs.append([o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)])
        llm.exit()
    assert outs[0] == outs[1]
    assert any(len(o) < n for o, n in zip(outs[0], lengths)), "no sequence stopped on eos"


def test_cuda_graph_sampling(eager_and_graph_engines) -> None:
    """Sampling with CUDA graphs. Temperature only: the graph samples (the Triton kernels),
    reproducibly under torch.manual_seed, and not just the argmax. top-p with per-request
    seeds: the PyTorch sampler outside the graph, whose tokens equal the eager engine's."""
    from myvllm import SamplingParams

    eager, graph = eager_and_graph_engines
    rng = random.Random(5)
    prompts = [[rng.randint(0, 150000) for _ in range(rng.randint(5, 100))] for _ in range(5)]
    hot = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    runs = []
    for _ in range(2):
        torch.manual_seed(0)
        runs.append([o["token_ids"] for o in graph.generate(prompts, hot, use_tqdm=False)])
    greedy = [o["token_ids"] for o in graph.generate(prompts, SamplingParams(**GREEDY_24),
                                                     use_tqdm=False)]
    assert runs[0] == runs[1]
    assert [t[:16] for t in greedy] != runs[0]
    seeded = [SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=16, ignore_eos=True)
              for i in range(len(prompts))]
    graph_out = graph.generate(prompts, seeded, use_tqdm=False)
    eager_out = eager.generate(prompts, seeded, use_tqdm=False)
    assert [o["token_ids"] for o in graph_out] == [o["token_ids"] for o in eager_out]


def test_prefix_cache_hit_gives_cold_tokens() -> None:
    """A second request reuses the first request's 160-token prefix (10 full blocks of 16),
    read by the prefill kernel through the block table, and gives exactly the tokens of an
    engine without prefix caching. On the tiny random Qwen3 (the kernel's cached-prefix path
    at the real shape is test_prefill_kernel_bf16_real_shapes[1024]), in fp32: a hit changes
    which tokens one prefill computes, hence the bf16 rounding of the prefix K/V, which can
    flip near-tied argmaxes of a random-weight model."""
    from helpers_models import random_prompts, tiny_checkpoint

    from myvllm import LLM, SamplingParams

    shared, tails = random_prompts([160], seed=7)[0], random_prompts([3, 40], seed=8)
    prompts = [shared + tail for tail in tails]
    path = str(tiny_checkpoint("qwen3"))
    tiny = dict(dtype="float32", max_model_length=256, num_kvcache_blocks=256)
    params = SamplingParams(**GREEDY_24)
    llm = LLM(path, enable_prefix_caching=False, **tiny)
    cold = llm.generate(prompts[1:], params, use_tqdm=False)[0]
    llm.exit()
    llm = LLM(path, **tiny)
    llm.generate(prompts[:1], params, use_tqdm=False)
    warm = llm.generate(prompts[1:], params, use_tqdm=False)[0]
    llm.exit()
    assert cold["num_cached_tokens"] == 0 and warm["num_cached_tokens"] == 160
    assert warm["token_ids"] == cold["token_ids"]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_tensor_parallel_2_nccl_equals_1(qwen3_random_checkpoint: Path) -> None:
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    rng = random.Random(3)
    prompts = [[rng.randint(0, 150000) for _ in range(rng.randint(5, 200))] for _ in range(8)]
    # fp32: TP sums each row-parallel matmul in two halves, a different rounding order;
    # in fp32 that is far below any logit gap, so the tokens must be identical.
    one = run_greedy(qwen3_random_checkpoint, prompts, dtype="float32")
    two = run_greedy(qwen3_random_checkpoint, prompts, dtype="float32", tensor_parallel_size=2)
    assert [o["token_ids"] for o in two] == [o["token_ids"] for o in one]
    # Chunked prefill with a budget of 64 tokens: the workers get each step's chunks
    # (num_computed_tokens, num_new_tokens) through the pickled sequences.
    chunked = run_greedy(qwen3_random_checkpoint, prompts, dtype="float32",
                         tensor_parallel_size=2, max_num_batched_tokens=64)
    assert [o["token_ids"] for o in chunked] == [o["token_ids"] for o in one]


def test_chunked_prefill_graphs_equal_eager_and_prefill_first(
        qwen3_random_checkpoint: Path) -> None:
    """Chunked prefill with a budget far below the prompts (256 tokens: mixed steps of prompt
    chunks and decode rows, replayed from chunk graphs, between pure decode steps that
    replay decode graphs): the tokens of CUDA graphs + async scheduling, of the eager engine
    (the same padded steps, launched one kernel at a time), and of prefill-first (whole
    prompts) are the same."""
    from myvllm import LLM, SamplingParams

    rng = random.Random(12)
    prompts = [[rng.randint(0, 150000) for _ in range(rng.randint(5, 900))] for _ in range(24)]
    params = SamplingParams(**GREEDY_24)
    outs = []
    for kwargs in (dict(max_num_batched_tokens=256),
                   dict(max_num_batched_tokens=256, enforce_eager=True, async_scheduling=False),
                   dict(enable_chunked_prefill=False, enforce_eager=True)):
        llm = LLM(str(qwen3_random_checkpoint), **{**ENGINE_ARGS, **kwargs})
        if not outs:
            assert llm.model_runner.graphs.sizes("prefill") == [16, 32, 64, 128, 256]
        outs.append([o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)])
        llm.exit()
    assert outs[0] == outs[1], "chunked: CUDA graphs + async differ from eager"
    # bf16: a prompt computed in chunks rounds differently from one computed whole, so
    # greedy tokens may part near ties; the first token of most prompts must agree.
    first = sum(a[0] == b[0] for a, b in zip(outs[1], outs[2]))
    assert first >= 0.9 * len(prompts), f"first tokens agree for {first} of {len(prompts)}"
