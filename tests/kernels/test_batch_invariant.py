"""Batch-invariant mode's kernels: a row's bits do not depend on its batch.

Each kernel is run on a row alone, inside batches of other rows at other places, with its
keys cached or not, in chunks, and as a decode row, and the results are compared with
torch.equal (bit for bit), and with the PyTorch references to a tolerance (the mode must
still compute the right thing).

On a CPU the Triton kernels run in the interpreter with a dot that sums in a fixed order, as
a GPU's matrix unit does (tests/helpers_invariant.py says why numpy's does not). The
interpreter's bf16 dot is wrong, so CPU runs use fp16 and fp32; the H200 run with bf16 is
tests/gpu/test_gpu_batch_invariant.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest
import torch
from helpers_kernels import DTYPES, HAS_CUDA, TOL
from helpers_invariant import batch_invariant, gpu_like_dot

from myvllm.kernels import (
    flash_attention_varlen,
    flash_attention_varlen_ref,
    matmul_batch_invariant,
    matmul_batch_invariant_ref,
    paged_attention_decode,
)
from myvllm.kernels.tile_map import TileMap, build_tile_map

if TYPE_CHECKING:  # prefill_attention imports Triton, which a test may skip without
    from myvllm.kernels.prefill_attention import PrefillConfig



@pytest.fixture
def device(monkeypatch: pytest.MonkeyPatch) -> Iterator[torch.device]:
    """The Triton kernels, in batch-invariant mode, on the GPU or in the interpreter."""
    pytest.importorskip("triton")
    monkeypatch.setenv("MYVLLM_FORCE_TRITON", "1")
    with gpu_like_dot(), batch_invariant():
        yield torch.device("cuda" if HAS_CUDA else "cpu")


def cu(*lengths: int, device: torch.device) -> torch.Tensor:
    total, out = 0, [0]
    for n in lengths:
        total += n
        out.append(total)
    return torch.tensor(out, dtype=torch.int32, device=device)


# ------------------------------------------------------------------------------ matmul
@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_matmul_rows_are_the_same_bits_in_any_batch(device, dtype, with_bias) -> None:
    k, n = 40, 37  # K is not a multiple of the K tile, N not of the N tile
    x = torch.randn(40, k, dtype=dtype, device=device)
    w = torch.randn(n, k, dtype=dtype, device=device)
    bias = torch.randn(n, dtype=dtype, device=device) if with_bias else None
    full = matmul_batch_invariant(x, w, bias)
    expected = x.float() @ w.float().t() + (bias.float() if bias is not None else 0)
    torch.testing.assert_close(full.float(), expected, atol=TOL[dtype] * k, rtol=TOL[dtype])
    for lo, hi in [(0, 1), (7, 8), (39, 40), (3, 20), (17, 40)]:  # alone, other tile offsets
        assert torch.equal(matmul_batch_invariant(x[lo:hi], w, bias), full[lo:hi]), (lo, hi)
    # The same rows at other places of a larger batch of other rows.
    other = torch.randn(21, k, dtype=dtype, device=device)
    mixed = matmul_batch_invariant(torch.cat([other[:13], x, other[13:]]), w, bias)
    assert torch.equal(mixed[13:53], full)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
def test_matmul_plans_and_row_tiles_give_the_same_bits(device, dtype) -> None:
    """The "tiles" plan (chunk partials summed in registers) and the "split" plan (one
    program per chunk, the last one summing the stored partials in order), each with either
    row tile, give every row the same bits, at every M and place in the batch. K = 72: three
    chunks of 32 on the interpreter's tiles, the last one short and not a whole K tile."""
    from myvllm.kernels.invariant_matmul_kernel import (_tile_counters, invariant_matmul_triton,
                                                        matmul_config)

    cfg = matmul_config(device, dtype)
    k, n = 72, 37
    assert k > 2 * cfg.chunk_k and k % cfg.chunk_k and k % cfg.block_k  # what the test needs
    x = torch.randn(40, k, dtype=dtype, device=device)
    w = torch.randn(n, k, dtype=dtype, device=device)
    bias = torch.randn(n, dtype=dtype, device=device)
    full = invariant_matmul_triton(x, w, bias, plan=("tiles", cfg.block_m))
    expected = x.float() @ w.float().t() + bias.float()
    torch.testing.assert_close(full.float(), expected, atol=TOL[dtype] * k, rtol=TOL[dtype])
    plans = [(name, rows) for name in ("tiles", "split")
             for rows in (cfg.block_m, cfg.small_block_m)]
    for plan in plans:
        for lo, hi in [(0, 40), (0, 1), (7, 8), (3, 20), (17, 40)]:
            got = invariant_matmul_triton(x[lo:hi], w, bias, plan=plan)
            assert torch.equal(got, full[lo:hi]), (plan, lo, hi)
    # Each split launch's last programs zeroed their counters again (the next launch and a
    # CUDA graph's replay start from zero).
    assert not _tile_counters(device).any()
    # The automatic choice, at every M (one chunk's K too), agrees with the fixed plans.
    for rows in (1, 2, 5, 16, 33, 40):
        assert torch.equal(matmul_batch_invariant(x[:rows], w, bias), full[:rows]), rows


def test_matmul_plan_splits_decode_and_tiles_prefill_at_the_model_shapes() -> None:
    """matmul_plan on an H200-sized GPU (132 SMs), bf16, Qwen3-0.6B's layers: a decode batch
    splits K where its tiles alone would leave most SMs idle; a prefill tiles."""
    pytest.importorskip("triton")
    from myvllm.kernels.invariant_matmul_kernel import matmul_config, matmul_plan

    cfg = matmul_config(torch.device("cuda"), torch.bfloat16)  # a config only: no GPU used
    o_proj, down_proj, lm_head = (1024, 2048), (1024, 3072), (151936, 1024)
    assert matmul_plan(1, *o_proj, cfg, 132) == ("split", 64)
    assert matmul_plan(256, *down_proj, cfg, 132) == ("split", 64)
    assert matmul_plan(1, *lm_head, cfg, 132) == ("tiles", 128)
    assert matmul_plan(8192, *o_proj, cfg, 132) == ("tiles", 128)
    assert matmul_plan(2048, *o_proj, cfg, 132) == ("tiles", 64)
    with pytest.raises(ValueError, match="plan"):
        from myvllm.kernels.invariant_matmul_kernel import invariant_matmul_triton

        invariant_matmul_triton(torch.ones(2, 8), torch.ones(4, 8), plan=("fast", 16))


def test_matmul_refuses_mismatched_shapes(device) -> None:
    x = torch.randn(3, 8, device=device)
    with pytest.raises(ValueError, match="must be \\[M, K\\] and \\[N, K\\]"):
        matmul_batch_invariant(x, torch.randn(5, 9, device=device))
    with pytest.raises(ValueError, match="bias"):
        matmul_batch_invariant(x, torch.randn(5, 8, device=device),
                               torch.randn(4, device=device))


def test_cpu_reference_matmul_is_invariant_on_this_cpu() -> None:
    """What the CPU's torch path does in the mode (F.linear on rows padded to a multiple of
    8): measured invariant on our CPUs, checked here on whichever CPU runs the tests."""
    x, w = torch.randn(41, 64), torch.randn(96, 64)
    full = matmul_batch_invariant_ref(x, w)
    torch.testing.assert_close(full, x @ w.t(), atol=1e-4, rtol=1e-4)
    for rows in range(1, 42):
        assert torch.equal(matmul_batch_invariant_ref(x[:rows], w), full[:rows]), rows
    for lo in range(0, 41, 5):
        assert torch.equal(matmul_batch_invariant_ref(x[lo:lo + 1], w), full[lo:lo + 1]), lo


# ------------------------------------------------------------------------------ attention
def paged_copy(k: torch.Tensor, v: torch.Tensor, block_size: int, num_blocks: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """k/v [L, Hkv, D] stored in a paged cache in shuffled blocks -> (k_cache, v_cache,
    block table [1, blocks])."""
    length, heads, dim = k.shape
    k_cache = torch.zeros(num_blocks, block_size, heads, dim, dtype=k.dtype, device=k.device)
    v_cache = torch.zeros_like(k_cache)
    table = torch.randperm(num_blocks, device=k.device)[: -(-length // block_size)]
    positions = torch.arange(length, device=k.device)
    slots = table[positions // block_size] * block_size + positions % block_size
    k_cache.view(-1, heads, dim)[slots] = k
    v_cache.view(-1, heads, dim)[slots] = v
    return k_cache, v_cache, table.to(torch.int32)[None]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_rows_are_the_same_bits_cached_chunked_decoded_or_batched(device, dtype
                                                                            ) -> None:
    """One sequence of 24 tokens: in one go (K/V contiguous, no cache), after a cached
    prefix of 10 (K/V from the paged cache), in chunks of 5, 11 and 8, every token as a
    decode row, and behind another sequence in a varlen batch: the same bits per row."""
    length, hq, hkv, dim, block = 24, 2, 1, 16, 4
    q = torch.randn(length, hq, dim, dtype=dtype, device=device)
    k = torch.randn(length, hkv, dim, dtype=dtype, device=device)
    v = torch.randn(length, hkv, dim, dtype=dtype, device=device)
    k_cache, v_cache, table = paged_copy(k, v, block, num_blocks=16)
    scale = dim**-0.5

    def attend(lo: int, hi: int) -> torch.Tensor:  # queries lo..hi-1, keys 0..hi-1, paged
        return flash_attention_varlen(q[lo:hi].contiguous(), k, v, cu(hi - lo, device=device),
                                      cu(hi, device=device), hi - lo, hi, scale, table,
                                      k_cache, v_cache)

    whole = flash_attention_varlen(q, k, v, cu(length, device=device),
                                   cu(length, device=device), length, length, scale)
    reference = flash_attention_varlen_ref(q, k, v, cu(length, device=device),
                                           cu(length, device=device), length, length, scale)
    torch.testing.assert_close(whole.float(), reference.float(), atol=TOL[dtype],
                               rtol=TOL[dtype])
    assert torch.equal(attend(10, 24), whole[10:])
    assert torch.equal(torch.cat([attend(0, 5), attend(5, 16), attend(16, 24)]), whole)
    decoded = paged_attention_decode(
        q, k_cache, v_cache, table.expand(length, -1).contiguous(),
        torch.arange(1, length + 1, dtype=torch.int32, device=device), scale)
    assert torch.equal(decoded, whole)
    # Behind another sequence of 9 tokens: other query tiles, another place in the batch.
    q2, k2, v2 = (torch.randn(9, h, dim, dtype=dtype, device=device) for h in (hq, hkv, hkv))
    batched = flash_attention_varlen(
        torch.cat([q2, q]), torch.cat([k2, k]), torch.cat([v2, v]),
        cu(9, length, device=device), cu(9, length, device=device), length, length, scale)
    assert torch.equal(batched[9:], whole)


def test_attention_tile_map_without_splits_gives_the_same_bits(device) -> None:
    """The fixed grid of a padded chunked step (a CUDA graph's): a chunk of 14 after 10
    cached tokens, beside another sequence, through a tile map built without splits."""
    dtype, length, hq, hkv, dim, block = torch.float16, 24, 2, 1, 16, 4
    q = torch.randn(length, hq, dim, dtype=dtype, device=device)
    k = torch.randn(length, hkv, dim, dtype=dtype, device=device)
    v = torch.randn(length, hkv, dim, dtype=dtype, device=device)
    k_cache, v_cache, table = paged_copy(k, v, block, num_blocks=16)
    scale = dim**-0.5
    whole = flash_attention_varlen(q, k, v, cu(length, device=device),
                                   cu(length, device=device), length, length, scale)
    rows, combine = build_tile_map([3, 14], [3, 24], 16, 16, num_slots=8, num_parts=4,
                                   split_key_tiles=None)
    assert combine == [-1, 0, 0, 0] * 2  # no tile split
    tiles = TileMap(torch.tensor(rows, dtype=torch.int32, device=device).view(-1, 5),
                    torch.tensor(combine, dtype=torch.int32, device=device).view(-1, 4), 4)
    # Sequence 0: 3 tokens whose keys sit in the cache too (block table row 0 = table).
    tables = torch.cat([table, table])
    q_step = torch.cat([q[:3], q[10:]]).contiguous()
    out = flash_attention_varlen(q_step, k, v, cu(3, 14, device=device),
                                 cu(3, 24, device=device), 14, 24, scale, tables, k_cache,
                                 v_cache, tile_map=tiles)
    assert torch.equal(out[3:], whole[10:]) and torch.equal(out[:3], whole[:3])


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_rows_are_the_same_bits_with_any_query_tile(device, dtype) -> None:
    """The query tile (BLOCK_M) is free: a row reduces the same key tiles in the same order
    whatever the number of rows beside it. Prefill with 16- and 32-row tiles, and decode rows
    through the prefill kernel with 16-, 32- and 64-row tiles (decode_tile_config's choice
    on a GPU is 64 where the prefill's is 128), give every row the same bits."""
    from myvllm.kernels.prefill_attention import (PrefillConfig, decode_with_prefill_kernel,
                                                  flash_attention_varlen_triton)

    length, hq, hkv, dim, block = 40, 2, 1, 16, 4
    q = torch.randn(length, hq, dim, dtype=dtype, device=device)
    k = torch.randn(length, hkv, dim, dtype=dtype, device=device)
    v = torch.randn(length, hkv, dim, dtype=dtype, device=device)
    k_cache, v_cache, table = paged_copy(k, v, block, num_blocks=16)
    scale = dim**-0.5
    tiles = {rows: PrefillConfig(block_m=rows, block_n=16, num_warps=4, num_stages=1)
             for rows in (16, 32, 64)}
    seqlens = cu(length, device=device)
    by_tile = [flash_attention_varlen_triton(q, k, v, seqlens, seqlens, length, length, scale,
                                             config=tiles[rows], batch_invariant=True)
               for rows in (16, 32)]
    assert torch.equal(by_tile[0], by_tile[1])
    positions = torch.arange(1, length + 1, dtype=torch.int32, device=device)
    tables = table.expand(length, -1).contiguous()
    for rows in (16, 32, 64):
        decoded = decode_with_prefill_kernel(q, k_cache, v_cache, tables, positions, scale,
                                             config=tiles[rows])
        assert torch.equal(decoded, by_tile[0]), rows


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 2, 4])
def test_decode_rows_are_the_bits_of_the_prefill_last_row(device, dtype, group) -> None:
    """decode_with_prefill_kernel's row of context c is, bit for bit, the last row of a
    prefill of the sequence's first c tokens (K/V contiguous, no cache), for contexts of one
    key tile, less, more and not a multiple of it, and 1; a padding row (context 0) gives
    zeros. GQA groups 1, 2 and 4 over 2 KV heads: the group's query heads share a tile."""
    from myvllm.kernels.prefill_attention import decode_tile_config

    block_n = decode_tile_config(device, 16, dtype).block_n
    contexts = [1, 3, block_n - 1, block_n, block_n + 1, 2 * block_n + 5, 3 * block_n]
    check_decode_rows_against_prefill(device, dtype, group, 2, contexts)


def test_decode_rows_of_a_group_taller_than_the_query_tile(device) -> None:
    """20 query heads over one KV head in 16-row tiles: the group's heads fill two tiles
    (the second one 4 rows), with the same bits as the prefill's rows."""
    from myvllm.kernels.prefill_attention import PrefillConfig

    tiles = PrefillConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)
    check_decode_rows_against_prefill(device, torch.float16, 20, 1, [1, 17, 32], tiles)


def check_decode_rows_against_prefill(device: torch.device, dtype: torch.dtype, group: int,
                                      hkv: int, contexts: list[int],
                                      config: PrefillConfig | None = None) -> None:
    from myvllm.kernels.prefill_attention import (decode_with_prefill_kernel,
                                                  flash_attention_varlen_triton)

    dim, block = 16, 4
    length = max(contexts)
    q = torch.randn(length, hkv * group, dim, dtype=dtype, device=device)
    k = torch.randn(length, hkv, dim, dtype=dtype, device=device)
    v = torch.randn(length, hkv, dim, dtype=dtype, device=device)
    k_cache, v_cache, table = paged_copy(k, v, block, num_blocks=16)
    scale = dim**-0.5
    # One varlen prefill of every context's prefix: sequence i is tokens 0 .. contexts[i]-1.
    prefixes = [slice(0, c) for c in contexts]
    seqlens = cu(*contexts, device=device)
    prefill = flash_attention_varlen_triton(
        torch.cat([q[s] for s in prefixes]), torch.cat([k[s] for s in prefixes]),
        torch.cat([v[s] for s in prefixes]), seqlens, seqlens, length, length, scale,
        config=config, batch_invariant=True)
    last_rows = prefill[seqlens[1:].long() - 1]
    # The decode batch: one row per context, and a padding row (context 0, no blocks).
    rows_q = torch.cat([q[[c - 1 for c in contexts]], q[:1]])
    tables = torch.cat([table.expand(len(contexts), -1), torch.full_like(table, -1)])
    lens = torch.tensor([*contexts, 0], dtype=torch.int32, device=device)
    decoded = decode_with_prefill_kernel(rows_q, k_cache, v_cache, tables.contiguous(), lens,
                                         scale, config=config)
    for i, c in enumerate(contexts):
        assert torch.equal(decoded[i], last_rows[i]), c
    assert torch.equal(decoded[-1], torch.zeros_like(decoded[-1]))
    reference = flash_attention_varlen_ref(q, k, v, cu(length, device=device),
                                           cu(length, device=device), length, length, scale)
    torch.testing.assert_close(decoded[:-1].float(),
                               reference[[c - 1 for c in contexts]].float(),
                               atol=TOL[dtype], rtol=TOL[dtype])


def test_decode_with_prefill_kernel_refuses_bad_context_lens(device) -> None:
    from myvllm.kernels.prefill_attention import decode_with_prefill_kernel

    k_cache = torch.zeros(2, 4, 1, 16, device=device)
    q = torch.zeros(3, 2, 16, device=device)
    tables = torch.zeros(3, 2, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match=r"context_lens of shape \(2,\).*allowed: a contiguous"):
        decode_with_prefill_kernel(q, k_cache, k_cache.clone(), tables,
                                   torch.ones(2, dtype=torch.int32, device=device), 0.25)


def test_decode_padding_rows_give_zeros(device) -> None:
    dtype, dim = torch.float16, 16
    k_cache = torch.randn(4, 4, 1, dim, dtype=dtype, device=device)
    q = torch.randn(2, 2, dim, dtype=dtype, device=device)
    tables = torch.tensor([[0, 1], [-1, -1]], dtype=torch.int32, device=device)
    out = paged_attention_decode(q, k_cache, k_cache.clone(), tables,
                                 torch.tensor([5, 0], dtype=torch.int32, device=device), 0.25)
    assert torch.equal(out[1], torch.zeros_like(out[1])) and out[0].abs().sum() > 0
