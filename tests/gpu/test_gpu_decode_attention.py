"""The decode attention kernel's two programs for the scores on the GPU (skipped without
CUDA), compiled, at Qwen3-0.6B's shapes (16 query heads, 8 kv heads, head_dim 128), bf16
queries over a bf16 and an fp8 cache, each value of decode_attention.DECODE_SCORES:

- against the float32 reference on the same cache: a full batch of the bench workload's
  contexts, long contexts, and batch 1 at 32k tokens (split-K: partials and their merge);
  16- and 256-token blocks;
- the dispatch (kernels.paged_attention_decode, what the engine calls) follows the switch;
- a CUDA graph's replay gives the eager call's bits (the engine replays decode from graphs).

Run on a GPU machine with
`PYTHONPATH=src python3 -m pytest tests/gpu/test_gpu_decode_attention.py -q`.
"""

from __future__ import annotations

import random

import pytest
import torch

from myvllm.kernels.fp8_kv_reference import FP8_DTYPE, quantize_kv

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

HQ, HKV, D = 16, 8, 128
K_SCALE, V_SCALE = 0.37, 1.9  # not 1.0: a kernel that forgot a scale would pass with 1.0
CASES = {
    "bench-batch": [random.Random(0).randint(100, 1100) for _ in range(256)],
    "long": [8000, 7999, 8001, 17] * 4,
    "batch-1-32k": [32768 - 5],
}


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.float() - ref.float()).norm() / ref.float().norm()).item()


def paged(lengths: list[int], block_size: int, cache_dtype: torch.dtype) -> tuple:
    """q and caches of shuffled blocks (fp8: K / K_SCALE, V / V_SCALE) -> (q, k_cache, v_cache,
    block_tables, context_lens, k_scale, v_scale)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    per_seq = [-(-n // block_size) for n in lengths]
    num_blocks = sum(per_seq) + 3
    fp8 = cache_dtype == FP8_DTYPE
    scales = (K_SCALE, V_SCALE) if fp8 else (1.0, 1.0)
    shape = (num_blocks, block_size, HKV, D)
    k_cache, v_cache = (quantize_kv(torch.randn(shape, device="cuda", generator=gen),
                                    cache_dtype, s) for s in scales)
    order = torch.randperm(num_blocks, device="cuda", generator=gen).int()
    tables = torch.full((len(lengths), max(per_seq)), -1, dtype=torch.int32, device="cuda")
    used = 0
    for b, n in enumerate(per_seq):
        tables[b, :n] = order[used:used + n]
        used += n
    q = torch.randn(len(lengths), HQ, D, device="cuda", generator=gen).bfloat16()
    ctx = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    return q, k_cache, v_cache, tables, ctx, *scales


@pytest.mark.parametrize("scores", ["dot", "cuda_cores"])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8_DTYPE], ids=["bf16", "fp8"])
@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("case", list(CASES))
def test_decode_programs_match_the_reference(scores, cache_dtype, block_size, case) -> None:
    from myvllm.kernels import paged_attention_decode_ref
    from myvllm.kernels.decode_attention import paged_attention_decode_triton

    q, k_cache, v_cache, tables, ctx, ks, vs = paged(CASES[case], block_size, cache_dtype)
    out = paged_attention_decode_triton(q, k_cache, v_cache, tables, ctx, D**-0.5,
                                        k_scale=ks, v_scale=vs, scores=scores)
    ref = paged_attention_decode_ref(q, k_cache, v_cache, tables, ctx, D**-0.5, ks, vs)
    assert not torch.isnan(out).any()
    assert rel_err(out, ref) < 1e-2
    assert (out.float() - ref.float()).abs().max().item() < 2e-2


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8_DTYPE], ids=["bf16", "fp8"])
def test_the_engine_call_follows_the_switch_and_replays_from_a_graph(cache_dtype,
                                                                      monkeypatch) -> None:
    from myvllm.kernels import decode_attention, paged_attention_decode, paged_attention_decode_ref

    q, k_cache, v_cache, tables, ctx, ks, vs = paged(CASES["bench-batch"][:64], 16, cache_dtype)
    ref = paged_attention_decode_ref(q, k_cache, v_cache, tables, ctx, D**-0.5, ks, vs)
    outs = {}
    for value in ("dot", "cuda_cores"):
        monkeypatch.setattr(decode_attention, "DECODE_SCORES", value)
        eager = paged_attention_decode(q, k_cache, v_cache, tables, ctx, D**-0.5, ks, vs)
        assert rel_err(eager, ref) < 1e-2
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = paged_attention_decode(q, k_cache, v_cache, tables, ctx, D**-0.5, ks, vs)
        graph.replay()
        assert torch.equal(captured, eager)
        outs[value] = eager
    # Two programs, two summation orders: not the same bits, the same values.
    assert not torch.equal(outs["dot"], outs["cuda_cores"])
