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


@pytest.mark.parametrize("n, k", [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072),
                                  (151936, 1024)])
def test_matmul_plans_give_the_same_bits_in_bf16(n: int, k: int) -> None:
    """Qwen3-0.6B's matmuls in bf16: the "split" plan (decode) and the "tiles" plan
    (prefill), with 64- or 128-row tiles, give every row the bits of the 128-row tiles plan,
    at every row count from 1 to 300 and as the automatic choice; the K chunks' sum is the
    same by construction, the row tiles share the wgmma instruction (the claim this checks on
    the hardware)."""
    from myvllm.kernels.invariant_matmul_kernel import invariant_matmul_triton

    gen = torch.Generator().manual_seed(n + k)
    x = torch.randn(300, k, generator=gen).to("cuda", torch.bfloat16)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to("cuda", torch.bfloat16)
    full = invariant_matmul_triton(x, w, plan=("tiles", 128))
    torch.testing.assert_close(full.float(), x.float() @ w.float().t(), atol=3e-2, rtol=2e-2)
    for plan in [("tiles", 64), ("split", 64), ("split", 128)]:
        assert torch.equal(invariant_matmul_triton(x, w, plan=plan), full), plan
    for rows in (1, 2, 3, 8, 17, 64, 65, 256):
        assert torch.equal(invariant_matmul_triton(x[:rows], w), full[:rows]), rows
        assert torch.equal(invariant_matmul_triton(x[-rows:], w), full[-rows:]), rows


def test_attention_decode_tile_gives_the_prefill_tile_bits_in_bf16() -> None:
    """A decode row through the prefill kernel's 64-row decode tile (decode_tile_config) gets
    the bits of the same row in a 128-row prefill tile, bf16, head_dim 128, GQA 16/8, over a
    paged cache of 16-token blocks (contexts of 1 to 700 tokens: partial key tiles too)."""
    from myvllm.kernels.prefill_attention import (decode_tile_config, decode_with_prefill_kernel,
                                                  flash_attention_varlen_triton, prefill_config)

    device, dtype = torch.device("cuda"), torch.bfloat16
    length, hq, hkv, dim, block = 700, 16, 8, 128, 16
    decode_rows = decode_tile_config(device, dim, dtype).block_m
    assert decode_rows < prefill_config(device, dim, dtype).block_m
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(length, h, dim, generator=gen).to(device, dtype)
               for h in (hq, hkv, hkv))
    blocks = -(-length // block)
    table = torch.randperm(blocks + 3, generator=gen)[:blocks].to(device, torch.int32)
    k_cache = torch.zeros(blocks + 3, block, hkv, dim, dtype=dtype, device=device)
    v_cache = torch.zeros_like(k_cache)
    positions = torch.arange(length, device=device)
    slots = table.long()[positions // block] * block + positions % block
    k_cache.view(-1, hkv, dim)[slots] = k
    v_cache.view(-1, hkv, dim)[slots] = v
    cu = torch.tensor([0, length], dtype=torch.int32, device=device)
    prefill = flash_attention_varlen_triton(q, k, v, cu, cu, length, length, dim**-0.5,
                                            table[None], k_cache, v_cache, batch_invariant=True)
    decoded = decode_with_prefill_kernel(
        q, k_cache, v_cache, table[None].expand(length, -1).contiguous(),
        torch.arange(1, length + 1, dtype=torch.int32, device=device), dim**-0.5)
    assert torch.equal(decoded, prefill)
