"""The Triton kernels (three attention kernels, three per-token layer ops, the sampling
kernels, the skinny matmul) against their PyTorch references, and the references against
deliberately dumb loop implementations (so the oracle itself is checked); also the naive
baseline kernels of the benchmark scripts (benchmarks/baselines.py).

On a machine without a GPU the Triton kernels run in Triton's CPU interpreter. Triton decides
between compiling and interpreting when a function is decorated with @triton.jit, from the
environment variable TRITON_INTERPRET, and a process cannot switch afterwards. tests/conftest.py
sets TRITON_INTERPRET=1 on a CPU-only machine before any test module is imported, so every
kernel in this pytest process is interpreted whichever tests ran first; this file only checks
that it really is (the `device` fixture fails otherwise) and never reloads a module.

The interpreter's bf16 tl.dot is wrong, so CPU runs use fp16 and fp32 only; on a GPU the
kernels run compiled and bf16 is tested too.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
from types import ModuleType

import pytest
import torch
from helpers_kernels import DTYPES, HAS_CUDA, TOL, paged_caches

import myvllm.kernels as kernels
import myvllm.kernels.fused_ops as fused_ops
import myvllm.kernels.fused_reference as fused_reference
import myvllm.kernels.tile_map as tile_map
from myvllm.kernels import (
    flash_attention_varlen_ref,
    paged_attention_decode_ref,
    store_kvcache_ref,
)



@pytest.fixture(scope="module")
def device() -> torch.device:
    """Where the Triton kernels run: the GPU, or the CPU interpreter."""
    pytest.importorskip("triton")  # the engine runs without it (the PyTorch references)
    if HAS_CUDA:
        return torch.device("cuda")
    import triton.language.standard as standard
    from triton.runtime.interpreter import InterpretedFunction

    assert isinstance(standard.zeros, InterpretedFunction), (
        "triton was imported in compiled mode before tests/conftest.py set TRITON_INTERPRET=1 "
        "(by a pytest plugin?); run pytest with TRITON_INTERPRET=1 in the environment")
    return torch.device("cpu")


def triton_mod(name: str) -> ModuleType:
    """A kernel module, imported on first use: without triton only the tests that take the
    `device` fixture (or importorskip) are skipped, the references are still tested."""
    return importlib.import_module(f"myvllm.kernels.{name}")


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert not torch.isnan(actual).any(), "NaN in output"
    err = (actual.float() - expected.float()).abs().max().item()
    assert err <= TOL[dtype], f"max abs error {err} > {TOL[dtype]} for {dtype}"


# --------------------------------------------------------------------------- helpers


def cu_seqlens(lengths: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor([0] + [sum(lengths[: i + 1]) for i in range(len(lengths))],
                        dtype=torch.int32, device=device)  # fmt: skip


def make_paged(
    k: torch.Tensor, v: torch.Tensor, lengths: list[int], block_size: int, spare_blocks: int = 3
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Scatter contiguous per-sequence K/V [sum(lengths), Hkv, D] into a paged cache of k's
    dtype with a shuffled block order (helpers_kernels.paged_caches). Unused slots hold NaN
    so any read of them shows up in the output."""
    return paged_caches(k, v, lengths, block_size, k.dtype, spare_blocks)


def dumb_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """One sequence, loops over heads, an explicit mask built element by element, float64.
    q [Sq, Hq, D] are the last Sq of the Sk positions in k/v [Sk, Hkv, D]."""
    sq, hq, _ = q.shape
    sk, hkv, _ = k.shape
    mask = torch.zeros(sq, sk, dtype=torch.bool)
    for i in range(sq):
        for j in range(sk):
            mask[i, j] = j <= (sk - sq) + i
    out = torch.empty(sq, hq, q.shape[2], dtype=torch.float64)
    for h in range(hq):
        kv_h = h // (hq // hkv)
        scores = q[:, h].double() @ k[:, kv_h].double().T * scale
        scores[~mask] = float("-inf")
        out[:, h] = torch.softmax(scores, dim=-1) @ v[:, kv_h].double()
    return out


# --------------------------------------------------------------------------- the oracle


def test_store_kvcache_ref_matches_loop() -> None:
    torch.manual_seed(0)
    key, value = torch.randn(6, 2, 8), torch.randn(6, 2, 8)
    slots = torch.tensor([5, -1, 0, 17, -1, 9], dtype=torch.int32)
    k_cache, v_cache = torch.zeros(3, 8, 2, 8), torch.zeros(3, 8, 2, 8)
    store_kvcache_ref(key, value, k_cache, v_cache, slots)
    k_loop, v_loop = torch.zeros(3, 8, 2, 8), torch.zeros(3, 8, 2, 8)
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            k_loop[s // 8, s % 8], v_loop[s // 8, s % 8] = key[i], value[i]
    assert torch.equal(k_cache, k_loop) and torch.equal(v_cache, v_loop)


@pytest.mark.parametrize("paged", [False, True])
def test_flash_attention_varlen_ref_matches_dumb(paged: bool) -> None:
    torch.manual_seed(0)
    lengths_k, lengths_q = [7, 1, 12], [7, 1, 5] if paged else [7, 1, 12]
    hq, hkv, d, scale = 4, 2, 8, 0.3
    k, v = torch.randn(sum(lengths_k), hkv, d), torch.randn(sum(lengths_k), hkv, d)
    q = torch.randn(sum(lengths_q), hq, d)
    cu_q, cu_k = cu_seqlens(lengths_q, q.device), cu_seqlens(lengths_k, q.device)
    extra = make_paged(k, v, lengths_k, block_size=4) if paged else (None, None, None)
    k_cache, v_cache, tables = extra
    out = flash_attention_varlen_ref(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), scale,
                                     tables, k_cache, v_cache)  # fmt: skip
    for b in range(len(lengths_q)):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        expected = dumb_causal_attention(q[qs], k[ks], v[ks], scale)
        torch.testing.assert_close(out[qs].double(), expected, atol=1e-5, rtol=1e-5)


def test_paged_attention_decode_ref_matches_dumb() -> None:
    torch.manual_seed(0)
    lengths, hq, hkv, d, scale = [5, 9, 1], 4, 1, 8, 0.4
    k, v = torch.randn(sum(lengths), hkv, d), torch.randn(sum(lengths), hkv, d)
    q = torch.randn(len(lengths), hq, d)
    k_cache, v_cache, tables = make_paged(k, v, lengths, block_size=4)
    out = paged_attention_decode_ref(q, k_cache, v_cache, tables,
                                     torch.tensor(lengths, dtype=torch.int32), scale)  # fmt: skip
    start = 0
    for b, n in enumerate(lengths):
        for h in range(hq):  # the new token attends to every cached token: no mask at all
            kh, vh = k[start : start + n, h // (hq // hkv)], v[start : start + n, h // (hq // hkv)]
            probs = torch.softmax(q[b, h].double() @ kh.double().T * scale, dim=-1)
            torch.testing.assert_close(out[b, h].double(), probs @ vh.double(),
                                       atol=1e-5, rtol=1e-5)  # fmt: skip
        start += n


def test_paged_attention_decode_ref_empty_context_gives_zeros() -> None:
    q = torch.randn(2, 2, 8)
    cache = torch.full((2, 4, 1, 8), float("nan"))
    tables = torch.tensor([[0, 1], [-1, -1]], dtype=torch.int32)
    out = paged_attention_decode_ref(q, cache, cache, tables,
                                     torch.tensor([3, 0], dtype=torch.int32), 0.5)  # fmt: skip
    assert torch.isnan(out[0]).all()  # the cache really is NaN: sequence 0 reads it
    assert torch.equal(out[1], torch.zeros(2, 8))


# --------------------------------------------------------------------------- store_kvcache


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size,num_kv_heads,head_dim", [(1, 2, 16), (16, 1, 24), (256, 2, 32)])
def test_store_kvcache_triton(device, dtype, block_size, num_kv_heads, head_dim) -> None:
    torch.manual_seed(0)
    n = 9
    num_blocks = math.ceil(n / block_size) + 2
    # key/value as strided views of a wider qkv-like tensor, as the attention layer passes them
    wide = torch.randn(n, 3, num_kv_heads, head_dim, device=device).to(dtype)
    key, value = wide[:, 1], wide[:, 2]
    slots = torch.randperm(num_blocks * block_size)[:n].int()
    slots[[1, 4, 8]] = -1  # padding tokens
    slots = slots.to(device)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, 7.0, dtype=dtype, device=device)
    v_cache = torch.full(shape, 7.0, dtype=dtype, device=device)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    triton_mod("store_kvcache_kernel").store_kvcache_triton(key, value, k_cache, v_cache, slots)
    store_kvcache_ref(key, value, k_ref, v_ref, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


# --------------------------------------------------------------------------- prefill


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(2, 2, 32), (4, 2, 16), (4, 1, 24)])
@pytest.mark.parametrize("use_tma", [False, True])
def test_flash_attention_varlen_triton_contiguous(device, dtype, num_heads, num_kv_heads,
                                                  head_dim, use_tma) -> None:  # fmt: skip
    torch.manual_seed(0)
    lengths = [1, 37, 16, 5]
    n = sum(lengths)
    qkv = torch.randn(n, num_heads + 2 * num_kv_heads, head_dim, device=device).to(dtype)
    q, k, v = qkv.split([num_heads, num_kv_heads, num_kv_heads], dim=1)  # strided views
    cu = cu_seqlens(lengths, device)
    scale = head_dim**-0.5
    args = (q, k, v, cu, cu, max(lengths), max(lengths), scale)
    mod = triton_mod("prefill_attention")
    # Both load paths: per-element pointers, and tensor descriptors (TMA on Hopper; head_dim
    # 24 is not a power of two, so that case checks the fallback to pointers).
    cfg = dataclasses.replace(mod.prefill_config(device, head_dim), use_tma=use_tma)
    out = mod.flash_attention_varlen_triton(*args, config=cfg)
    assert_close(out, flash_attention_varlen_ref(*args), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size,num_heads,num_kv_heads", [(1, 2, 2), (16, 4, 2), (256, 4, 1)])
def test_flash_attention_varlen_triton_paged_prefix(device, dtype, block_size, num_heads,
                                                    num_kv_heads) -> None:  # fmt: skip
    torch.manual_seed(0)
    head_dim = 16
    lengths_k = [21, 3, 40]  # whole context: cached prefix + new tokens
    lengths_q = [4, 3, 19]  # new tokens (sequence 1 has no cached prefix)
    k = torch.randn(sum(lengths_k), num_kv_heads, head_dim, device=device).to(dtype)
    v = torch.randn(sum(lengths_k), num_kv_heads, head_dim, device=device).to(dtype)
    q = torch.randn(sum(lengths_q), num_heads, head_dim, device=device).to(dtype)
    k_cache, v_cache, tables = make_paged(k, v, lengths_k, block_size)
    cu_q, cu_k = cu_seqlens(lengths_q, device), cu_seqlens(lengths_k, device)
    args = (q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), 0.25, tables, k_cache, v_cache)
    out = triton_mod("prefill_attention").flash_attention_varlen_triton(*args)
    assert_close(out, flash_attention_varlen_ref(*args), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split_key_tiles", [1, 1000])
def test_flash_attention_varlen_triton_tile_map(device, dtype, split_key_tiles) -> None:
    """A fixed grid read from a tile map (what a CUDA graph of a chunked step replays): the
    same output on every row that has a tile, with unused rows, tiles cut along their keys
    (split-K, merged by the combine kernel) or whole, padding rows and a row left to the
    caller (a decode row) that stay unwritten."""
    torch.manual_seed(0)
    mod = triton_mod("prefill_attention")
    num_heads, num_kv_heads, head_dim, block_size = 4, 2, 16, 4
    cfg = mod.prefill_config(device, head_dim, dtype)
    # A chunk with three key tiles cached before it, a decode row, a prompt, a chunk.
    lengths_k = [35 + 3 * cfg.block_n, 6, 23, 40]  # whole context
    lengths_q = [35, 1, 23, 2]  # new tokens
    k = torch.randn(sum(lengths_k), num_kv_heads, head_dim, device=device).to(dtype)
    v = torch.randn(sum(lengths_k), num_kv_heads, head_dim, device=device).to(dtype)
    padded = sum(lengths_q) + 5  # five padding rows after the real ones
    q = torch.randn(padded, num_heads, head_dim, device=device).to(dtype)
    k_cache, v_cache, tables = make_paged(k, v, lengths_k, block_size)
    cu_q, cu_k = cu_seqlens(lengths_q, device), cu_seqlens(lengths_k, device)
    num_parts = 8
    slots = tile_map.tile_map_slots(padded, max_num_seqs=8, block_m=cfg.block_m,
                                    num_parts=num_parts)
    tiled_q = [0 if n == 1 else n for n in lengths_q]  # the decode row gets no tile
    rows, combine = tile_map.build_tile_map(tiled_q, lengths_k, cfg.block_m, cfg.block_n,
                                            slots, num_parts, split_key_tiles)
    assert rows[-5:] == [-1, 0, 0, 1, -1]  # more rows than programs: the rest run nothing
    assert (combine[0] != -1) == (split_key_tiles == 1)  # some tiles split, or none
    the_map = tile_map.TileMap(
        torch.tensor(rows, dtype=torch.int32, device=device).view(-1, 5),
        torch.tensor(combine, dtype=torch.int32, device=device).view(-1, 4), num_parts)
    args = (q, k, v, cu_q, cu_k, 0, 0, 0.25, tables, k_cache, v_cache)
    out = torch.full_like(q, 7.0)
    mod.flash_attention_varlen_triton(*args, the_map, out)
    ref = flash_attention_varlen_ref(*args)
    tiled = torch.ones(padded, dtype=torch.bool)
    tiled[sum(lengths_q):] = False
    tiled[lengths_q[0]] = False  # the decode row
    assert_close(out[tiled], ref[tiled], dtype)
    assert torch.all(out[~tiled] == 7.0)


def test_build_tile_map_lists_the_heaviest_tiles_first_and_splits_them() -> None:
    rows, combine = tile_map.build_tile_map([300, 1], [1324, 7], 128, 128, 5, 2)
    assert rows == [0, 2, 0, 1, -1, 0, 1, 0, 1, -1, 0, 0, 0, 1, -1, 1, 0, 0, 1, -1,
                    -1, 0, 0, 1, -1]
    assert combine == [-1, 0, 0, 0]
    # A 100-token chunk after 1000 cached tokens (7 unmasked key tiles of 128), cut into
    # splits of at least 2 key tiles: 3 splits, as many parts, one combine row.
    rows, combine = tile_map.build_tile_map([100], [1100], 128, 128, 6, 4, split_key_tiles=2)
    assert rows[:15] == [0, 0, 0, 3, 0, 0, 0, 1, 3, 1, 0, 0, 2, 3, 2]
    assert combine == [0, 0, 3, 0, -1, 0, 0, 0]
    assert tile_map.tile_map_slots(300, max_num_seqs=2, block_m=128, num_parts=4) == 9
    with pytest.raises(ValueError, match="3 query tiles, only 2 slots"):
        tile_map.build_tile_map([300], [300], 128, 128, 2, 0)


# --------------------------------------------------------------------------- decode


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits", [1, 3, None])
@pytest.mark.parametrize(
    "block_size,num_heads,num_kv_heads", [(1, 2, 2), (16, 4, 2), (256, 4, 1), (16, 8, 2)]
)
def test_paged_attention_decode_triton(device, dtype, num_splits, block_size, num_heads,
                                       num_kv_heads) -> None:  # fmt: skip
    torch.manual_seed(0)
    head_dim = 32
    lengths = [1, 45, 0, 17]  # 0 = a padding row (as in a CUDA-graph batch)
    k = torch.randn(sum(lengths), num_kv_heads, head_dim, device=device).to(dtype)
    v = torch.randn(sum(lengths), num_kv_heads, head_dim, device=device).to(dtype)
    k_cache, v_cache, tables = make_paged(k, v, lengths, block_size)
    qkv = torch.randn(len(lengths), 2 * num_heads, head_dim, device=device).to(dtype)
    q = qkv[:, :num_heads]  # strided view
    ctx = torch.tensor(lengths, dtype=torch.int32, device=device)
    args = (q, k_cache, v_cache, tables, ctx, head_dim**-0.5)
    mod = triton_mod("decode_attention")
    out = mod.paged_attention_decode_triton(*args, num_splits=num_splits)
    assert_close(out, paged_attention_decode_ref(*args), dtype)
    assert torch.equal(out[2], torch.zeros_like(out[2]))  # empty context -> zeros, not NaN


def test_choose_num_splits_depends_on_shapes_only() -> None:
    pytest.importorskip("triton")
    choose = triton_mod("decode_attention").choose_num_splits
    assert choose(batch=64, num_kv_heads=8, max_context=4096, sm_count=132) == 1  # GPU full
    one = choose(batch=1, num_kv_heads=8, max_context=32768, sm_count=132)
    assert one > 1 and one & (one - 1) == 0  # split, and a power of two
    assert choose(batch=1, num_kv_heads=8, max_context=128, sm_count=132) == 1  # too short
    assert choose(batch=1, num_kv_heads=1, max_context=10**6, sm_count=10**4) <= 32


# --------------------------------------------------------------------------- baselines


def test_baseline_kernels_match_references(device) -> None:
    from benchmarks import baselines as mod

    torch.manual_seed(0)
    dtype, lengths, hq, hkv, d = torch.float16, [9, 30], 4, 2, 16
    q = torch.randn(sum(lengths), hq, d, device=device).to(dtype)
    k = torch.randn(sum(lengths), hkv, d, device=device).to(dtype)
    v = torch.randn(sum(lengths), hkv, d, device=device).to(dtype)
    cu = cu_seqlens(lengths, device)
    out = mod.naive_attention_prefill_triton(q, k, v, cu, max(lengths), 0.25)
    assert_close(out, flash_attention_varlen_ref(q, k, v, cu, cu, 30, 30, 0.25), dtype)
    with pytest.raises(ValueError, match="up to"):
        mod.naive_attention_prefill_triton(q, k, v, cu, mod.NAIVE_PREFILL_MAX_SEQLEN + 1, 0.25)
    k_cache, v_cache, tables = make_paged(k, v, lengths, block_size=16)
    qd = q[: len(lengths)].contiguous()
    ctx = torch.tensor(lengths, dtype=torch.int32, device=device)
    out = mod.paged_attention_decode_per_head_triton(qd, k_cache, v_cache, tables, ctx, 0.25)
    assert_close(out, paged_attention_decode_ref(qd, k_cache, v_cache, tables, ctx, 0.25), dtype)


# --------------------------------------------------------------------------- dispatch


def test_dispatch_picks_triton_when_forced_and_reference_otherwise(device, monkeypatch) -> None:
    torch.manual_seed(0)
    calls: list[str] = []
    for module, name in [("store_kvcache_kernel", "store_kvcache_triton"),
                         ("prefill_attention", "flash_attention_varlen_triton"),
                         ("decode_attention", "paged_attention_decode_triton")]:  # fmt: skip
        real = getattr(triton_mod(module), name)

        def spy(*args, _real=real, _name=name, **kwargs):
            calls.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(triton_mod(module), name, spy)

    k = torch.randn(5, 1, 16, device=device, dtype=torch.float16)
    q = torch.randn(5, 2, 16, device=device, dtype=torch.float16)
    k_cache, v_cache, tables = make_paged(k, k, [5], block_size=4)
    cu = cu_seqlens([5], device)
    ctx = torch.tensor([5], dtype=torch.int32, device=device)

    slots = torch.tensor([int(tables[0, p // 4]) * 4 + p % 4 for p in range(5)],
                         dtype=torch.int32, device=device)  # fmt: skip

    def run_all() -> tuple[torch.Tensor, torch.Tensor]:
        kernels.store_kvcache(k, k, k_cache, v_cache, slots)
        pre = kernels.flash_attention_varlen(q, k, k, cu, cu, 5, 5, 0.25)
        dec = kernels.paged_attention_decode(q[:1], k_cache, v_cache, tables, ctx, 0.25)
        return pre, dec

    monkeypatch.setenv("MYVLLM_FORCE_TRITON", "0")
    ref_out = run_all()
    assert calls == []
    monkeypatch.setenv("MYVLLM_FORCE_TRITON", "1")
    tri_out = run_all()
    assert calls == ["store_kvcache_triton", "flash_attention_varlen_triton",
                     "paged_attention_decode_triton"]  # fmt: skip
    for a, b in zip(tri_out, ref_out):
        assert_close(a, b, torch.float16)
    monkeypatch.delenv("MYVLLM_FORCE_TRITON")
    assert kernels.use_triton(q) == (device.type == "cuda")


def test_gqa_head_counts_must_divide(device) -> None:
    q = torch.randn(4, 3, 16, device=device, dtype=torch.float16)
    k = torch.randn(4, 2, 16, device=device, dtype=torch.float16)
    cu = cu_seqlens([4], device)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        triton_mod("prefill_attention").flash_attention_varlen_triton(q, k, k, cu, cu, 4, 4, 1.0)


def test_prefill_kernel_refusals_say_what_is_allowed(device) -> None:
    """Bad inputs are refused before any launch, each naming what was given and what is
    allowed."""
    prefill = triton_mod("prefill_attention").flash_attention_varlen_triton
    q = torch.randn(4, 2, 16, device=device, dtype=torch.float16)
    cu = cu_seqlens([4], device)
    with pytest.raises(ValueError, match=r"scale=-1.0: allowed: a float > 0"):
        prefill(q, q, q, cu, cu, 4, 4, -1.0)
    strided = torch.randn(4, 16, 2, device=device, dtype=torch.float16).transpose(1, 2)
    with pytest.raises(ValueError, match=r"k 2, v 1: allowed: 1 each"):
        prefill(q, strided, q, cu, cu, 4, 4, 1.0)
    tables = torch.zeros(1, 1, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="is None: allowed: block_tables with both caches"):
        prefill(q, q, q, cu, cu, 4, 4, 1.0, tables)
    k_cache = torch.zeros(1, 4, 2, 16, device=device, dtype=torch.float16)
    v_cache = torch.zeros(1, 4, 2, 32, device=device, dtype=torch.float16)[..., :16]
    with pytest.raises(ValueError, match="allowed: equal strides"):
        prefill(q, q, q, cu, cu, 4, 4, 1.0, tables, k_cache, v_cache)


def test_decode_and_store_refusals_say_what_is_allowed(device) -> None:
    """The decode kernel and the cache store refuse bad layouts before any launch, naming what
    was given and what is allowed."""
    decode = triton_mod("decode_attention").paged_attention_decode_triton
    store = triton_mod("store_kvcache_kernel").store_kvcache_triton
    k_cache = torch.zeros(1, 4, 2, 16, device=device, dtype=torch.float16)
    v_cache = torch.zeros(1, 4, 2, 32, device=device, dtype=torch.float16)[..., :16]
    tables = torch.zeros(1, 1, dtype=torch.int32, device=device)
    lens = torch.ones(1, dtype=torch.int32, device=device)
    q3 = torch.randn(1, 3, 16, device=device, dtype=torch.float16)
    with pytest.raises(ValueError, match="num_heads=3 over num_kv_heads=2: allowed: num_heads a"):
        decode(q3, k_cache, k_cache, tables, lens, 1.0)
    q = torch.randn(1, 4, 16, device=device, dtype=torch.float16)
    with pytest.raises(ValueError, match="allowed: equal strides"):
        decode(q, k_cache, v_cache, tables, lens, 1.0)
    strided_q = torch.randn(1, 16, 4, device=device, dtype=torch.float16).transpose(1, 2)
    with pytest.raises(ValueError, match="q 4, caches 1: allowed: 1 each"):
        decode(strided_q, k_cache, k_cache, tables, lens, 1.0)
    key = torch.randn(1, 2, 16, device=device, dtype=torch.float16)
    slots = torch.zeros(1, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="allowed: equal strides, the last"):
        store(key, key, k_cache, v_cache, slots)
    strided_key = torch.randn(1, 16, 2, device=device, dtype=torch.float16).transpose(1, 2)
    with pytest.raises(ValueError, match="key 2, value 1: allowed: 1 each"):
        store(strided_key, key, k_cache, k_cache, slots)


# ---------------------------------------------------------------- per-token layer ops
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 64), (5, 100), (3, 1024)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_triton(device, dtype, rows, hidden, with_residual) -> None:
    torch.manual_seed(rows * hidden)
    x = (torch.randn(rows, hidden) * 3).to(device=device, dtype=dtype)
    residual = torch.randn(rows, hidden).to(device=device, dtype=dtype) if with_residual else None
    weight = (1 + torch.randn(hidden) * 0.1).to(device=device, dtype=dtype)
    got = triton_mod("layer_ops_triton").rms_norm_triton(x, weight, 1e-6, residual)
    want = kernels.rms_norm_ref(x, weight, 1e-6, residual)
    if with_residual:
        # The new residual stream is the sum rounded once: bit-identical.
        torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
        got, want = got[0], want[0]
    assert got.dtype == dtype and got.shape == x.shape
    assert_close(got, want, dtype)


def test_rms_norm_ref_matches_the_formula() -> None:
    x = torch.randn(4, 32, dtype=torch.float64)
    weight = torch.rand(32, dtype=torch.float64)
    rms = (x.pow(2).sum(-1, keepdim=True) / 32 + 1e-5).sqrt()
    torch.testing.assert_close(kernels.rms_norm_ref(x, weight, 1e-5), x / rms * weight)


def _cos_sin_table(max_position: int, head_dim: int, device) -> torch.Tensor:
    inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim)
    freqs = torch.outer(torch.arange(max_position).float(), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [32, 96, 128])
@pytest.mark.parametrize("with_norm", [False, True])
def test_norm_rope_triton(device, dtype, head_dim, with_norm) -> None:
    """q and k in one launch, each with its own head count and norm weight."""
    torch.manual_seed(head_dim)
    num_tokens, num_q_heads, num_k_heads = 7, 3, 2
    # q and k are strided views into one qkv row, as in the models.
    qkv = torch.randn(num_tokens, (num_q_heads + 2 * num_k_heads) * head_dim)
    qkv = qkv.to(device=device, dtype=dtype)
    q_size, k_size = num_q_heads * head_dim, num_k_heads * head_dim
    q = qkv[:, :q_size].view(num_tokens, num_q_heads, head_dim)
    k = qkv[:, q_size: q_size + k_size].view(num_tokens, num_k_heads, head_dim)
    positions = torch.tensor([0, 1, 2, 50, 51, 300, 511], device=device)
    table = _cos_sin_table(512, head_dim, device)

    def weight() -> torch.Tensor | None:
        return (1 + torch.randn(head_dim) * 0.1).to(device=device, dtype=dtype) if with_norm else None

    q_weight, k_weight = weight(), weight()
    got_q, got_k = triton_mod("layer_ops_triton").norm_rope_triton(
        q, k, positions, table, q_weight, k_weight, 1e-6)
    for got, x, w in ((got_q, q, q_weight), (got_k, k, k_weight)):
        want = kernels.norm_rope_ref(x, positions, table, w, 1e-6)
        assert got.shape == x.shape and got.is_contiguous()
        assert_close(got, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,block_size", [(32, 1), (96, 16), (128, 4)])
@pytest.mark.parametrize("with_norm", [False, True])
def test_norm_rope_store_kvcache_triton(device, dtype, head_dim, block_size, with_norm) -> None:
    """One launch = norm_rope, then store_kvcache of its k and of v: q and k as the reference
    rotates them, and the cache bit for bit what the store kernel writes from that k and v;
    padding tokens (slot -1) and the slots of no token stay untouched."""
    torch.manual_seed(head_dim + block_size)
    num_tokens, num_q_heads, num_kv_heads = 7, 4, 2
    q_size, kv_size = num_q_heads * head_dim, num_kv_heads * head_dim
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size).to(device=device, dtype=dtype)
    q = qkv[:, :q_size].view(num_tokens, num_q_heads, head_dim)  # strided views, as in models
    k = qkv[:, q_size: q_size + kv_size].view(num_tokens, num_kv_heads, head_dim)
    v = qkv[:, q_size + kv_size:].view(num_tokens, num_kv_heads, head_dim)
    positions = torch.tensor([0, 1, 2, 50, 51, 300, 511], device=device)
    table = _cos_sin_table(512, head_dim, device)
    weights = [(1 + torch.randn(head_dim) * 0.1).to(device=device, dtype=dtype)
               if with_norm else None for _ in range(2)]  # fmt: skip
    num_blocks = math.ceil(num_tokens / block_size) + 2
    slots = torch.randperm(num_blocks * block_size)[:num_tokens].int()
    slots[[1, 5]] = -1  # padding tokens
    slots = slots.to(device)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, 7.0, dtype=dtype, device=device)
    v_cache = torch.full(shape, 7.0, dtype=dtype, device=device)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()

    got_q, got_k = triton_mod("layer_ops_triton").norm_rope_store_kvcache_triton(
        q, k, v, positions, table, k_cache, v_cache, slots, *weights, 1e-6)
    for got, x, w in ((got_q, q, weights[0]), (got_k, k, weights[1])):
        assert got.shape == x.shape and got.is_contiguous()
        assert_close(got, kernels.norm_rope_ref(x, positions, table, w, 1e-6), dtype)
    store_kvcache_ref(got_k, v, k_ref, v_ref, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    # The rotation is the plain norm_rope kernel's, bit for bit.
    plain_q, plain_k = triton_mod("layer_ops_triton").norm_rope_triton(
        q, k, positions, table, *weights, 1e-6)
    assert torch.equal(got_q, plain_q) and torch.equal(got_k, plain_k)


def test_norm_rope_store_kvcache_refuses_mismatched_caches(device) -> None:
    mod = triton_mod("layer_ops_triton")
    q, k = torch.randn(3, 2, 16, device=device), torch.randn(3, 1, 16, device=device)
    table = _cos_sin_table(8, 16, device)
    positions, slots = torch.arange(3, device=device), torch.arange(3, device=device).int()
    cache = torch.zeros(2, 4, 1, 16, device=device)
    with pytest.raises(ValueError, match="v .* must match k"):
        mod.norm_rope_store_kvcache_triton(q, k, k[:, :, :8], positions, table, cache, cache,
                                           slots)  # fmt: skip
    with pytest.raises(ValueError, match="k_cache"):
        wrong = torch.zeros(2, 4, 2, 16, device=device)
        mod.norm_rope_store_kvcache_triton(q, k, k, positions, table, wrong, wrong, slots)
    with pytest.raises(ValueError, match="one slot per token"):
        mod.norm_rope_store_kvcache_triton(q, k, k, positions, table, cache, cache, slots[:2])


def test_norm_rope_ref_rotates_each_pair_by_its_angle() -> None:
    head_dim, position = 8, 3
    x = torch.randn(1, 1, head_dim, dtype=torch.float64)
    table = _cos_sin_table(4, head_dim, "cpu").double()
    out = kernels.norm_rope_ref(x, torch.tensor([position]), table)[0, 0]
    for i in range(head_dim // 2):  # pair (x[i], x[i + D/2]) is rotated like a 2-D vector
        angle = position / 10000 ** (2 * i / head_dim)
        a, b = x[0, 0, i], x[0, 0, i + head_dim // 2]
        assert torch.isclose(out[i], a * math.cos(angle) - b * math.sin(angle))
        assert torch.isclose(out[i + head_dim // 2], b * math.cos(angle) + a * math.sin(angle))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inter", [(1, 64), (3, 1500)])
def test_silu_and_mul_triton(device, dtype, rows, inter) -> None:
    torch.manual_seed(inter)
    x = (torch.randn(rows, 2 * inter) * 4).to(device=device, dtype=dtype)
    got = triton_mod("layer_ops_triton").silu_and_mul_triton(x)
    want = kernels.silu_and_mul_ref(x)
    assert got.shape == (rows, inter)
    assert_close(got, want, dtype)
    gate, up = x.double().chunk(2, dim=-1)
    torch.testing.assert_close(want.double(), gate * torch.sigmoid(gate) * up,
                               rtol=1e-2, atol=TOL[dtype])  # fmt: skip


def test_layer_ops_dispatch_to_triton_when_forced(device, monkeypatch) -> None:
    """The layer modules go through the dispatch, so MYVLLM_FORCE_TRITON reaches them."""
    from myvllm.layers.activation import SiluAndMul
    from myvllm.layers.fused import fuse
    from myvllm.layers.layernorm import RMSNorm
    from myvllm.layers.rotary_embedding import get_rope

    torch.manual_seed(0)
    x = torch.randn(3, 64, device=device)
    norm = RMSNorm(64).to(device)
    rope = get_rope(32, 64, 10000.0).to(device)
    q, k = torch.randn(3, 2, 32, device=device), torch.randn(3, 1, 32, device=device)
    positions = torch.tensor([0, 5, 9], device=device)
    q_norm = RMSNorm(32).to(device)
    fuse(q_norm, rope)  # as in Qwen3's attention (layers/fused.py)

    def run_all() -> list[torch.Tensor]:
        return [norm(x), *norm(x, x), SiluAndMul()(x), *rope(positions, q_norm(q), q_norm(k))]

    monkeypatch.setenv("MYVLLM_FORCE_TRITON", "0")
    ref_out = run_all()
    monkeypatch.setenv("MYVLLM_FORCE_TRITON", "1")
    calls = []
    mod = triton_mod("layer_ops_triton")
    for name in ("rms_norm_triton", "norm_rope_triton", "silu_and_mul_triton"):
        original = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _f=original, _n=name: calls.append(_n) or _f(*a))
    tri_out = run_all()
    assert sorted(set(calls)) == ["norm_rope_triton", "rms_norm_triton", "silu_and_mul_triton"]
    assert calls.count("norm_rope_triton") == 1, "q and k are meant to be one launch"
    for a, b in zip(tri_out, ref_out):
        assert a.shape == b.shape
        assert_close(a, b, torch.float32)


# ---------------------------------------------------------------- small-batch matmul
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n,k", [(1, 64, 96), (3, 37, 600), (8, 130, 1024)])
def test_skinny_gemm_triton(device, dtype, rows, n, k) -> None:
    """N and K not multiples of the tiles: the masks must hold; any row count 1..8."""
    torch.manual_seed(rows * n)
    x = torch.randn(rows, k).to(device=device, dtype=dtype)
    w = (torch.randn(n, k) / math.sqrt(k)).to(device=device, dtype=dtype)
    got = triton_mod("skinny_gemm_kernel").skinny_gemm_triton(x, w)
    want = kernels.skinny_gemm_ref(x, w)
    assert got.shape == (rows, n) and got.dtype == dtype
    assert_close(got, want, dtype)
    torch.testing.assert_close(want.double(), x.double() @ w.double().t(),
                               rtol=1e-2, atol=TOL[dtype])  # fmt: skip
    # Other tile shapes, as a tuning sweep would try them, give the same result.
    for config in [(2, 64, 1), (16, 128, 2)]:
        assert_close(triton_mod("skinny_gemm_kernel").skinny_gemm_triton(x, w, config), want, dtype)


def test_skinny_gemm_refuses_what_it_does_not_handle(device) -> None:
    gemm = triton_mod("skinny_gemm_kernel").skinny_gemm_triton
    with pytest.raises(ValueError, match="1..8"):
        gemm(torch.zeros(9, 16, device=device), torch.zeros(4, 16, device=device))
    with pytest.raises(ValueError, match="must be"):
        gemm(torch.zeros(2, 16, device=device), torch.zeros(4, 15, device=device))


def test_skinny_gemm_dispatch_to_triton_when_forced(device, monkeypatch) -> None:
    x, w = torch.randn(2, 48, device=device), torch.randn(20, 48, device=device)
    monkeypatch.setenv("MYVLLM_FORCE_TRITON", "1")
    calls = []
    mod = triton_mod("skinny_gemm_kernel")
    original = mod.skinny_gemm_triton
    monkeypatch.setattr(mod, "skinny_gemm_triton", lambda *a: calls.append(1) or original(*a))
    assert_close(kernels.skinny_gemm(x, w), kernels.skinny_gemm_ref(x, w), torch.float32)
    assert calls == [1]


# The fused prologues: K = 96 is not a power of two, and the configs below split it into
# several tiles (the last one partly masked), N = 8 / 40 into one / several programs.
FUSED_CONFIGS = [None, (2, 64, 1), (16, 32, 2)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("n,k", [(8, 64), (40, 96)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_skinny_gemm_triton(device, dtype, rows, n, k, with_residual) -> None:
    """One launch gives rms_norm_ref then skinny_gemm_ref; the new residual is bit-exact."""
    torch.manual_seed(rows * n + k)
    x = (torch.randn(rows, k) * 3).to(device=device, dtype=dtype)
    residual = torch.randn(rows, k).to(device=device, dtype=dtype) if with_residual else None
    norm_weight = (1 + torch.randn(k) * 0.1).to(device=device, dtype=dtype)
    w = (torch.randn(n, k) / math.sqrt(k)).to(device=device, dtype=dtype)
    want = fused_reference.rms_norm_skinny_gemm_ref(x, norm_weight, 1e-6, w, residual)
    for config in FUSED_CONFIGS:
        got = triton_mod("skinny_gemm_kernel").rms_norm_skinny_gemm_triton(
            x, norm_weight, 1e-6, w, residual, config)
        if with_residual:
            torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
            got = got[0]
        assert got.shape == (rows, n) and got.dtype == dtype
        assert_close(got, want[0] if with_residual else want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("n,k", [(8, 64), (40, 96)])
def test_silu_and_mul_skinny_gemm_triton(device, dtype, rows, n, k) -> None:
    torch.manual_seed(rows * n + k)
    x = (torch.randn(rows, 2 * k) * 2).to(device=device, dtype=dtype)
    # silu(gate) * up has a std of ~3: outputs of order 1, so the fp16 tolerance is ~1 ulp.
    w = (torch.randn(n, k) / (4 * math.sqrt(k))).to(device=device, dtype=dtype)
    want = fused_reference.silu_and_mul_skinny_gemm_ref(x, w)
    for config in FUSED_CONFIGS:
        got = triton_mod("skinny_gemm_kernel").silu_and_mul_skinny_gemm_triton(x, w, config)
        assert got.shape == (rows, n) and got.dtype == dtype
        assert_close(got, want, dtype)


def test_skinny_gemm_prologues_refuse_what_they_do_not_handle(device) -> None:
    mod = triton_mod("skinny_gemm_kernel")
    x, w = torch.zeros(2, 16, device=device), torch.zeros(4, 16, device=device)
    norm_weight = torch.ones(16, device=device)
    norm_gemm, silu_gemm = mod.rms_norm_skinny_gemm_triton, mod.silu_and_mul_skinny_gemm_triton
    with pytest.raises(ValueError, match="1..8"):
        norm_gemm(torch.zeros(9, 16, device=device), norm_weight, 1e-6, w)
    with pytest.raises(ValueError, match="1..8"):
        silu_gemm(torch.zeros(0, 32, device=device), w)
    with pytest.raises(ValueError, match=r"must be \[M, K\]"):
        norm_gemm(x, norm_weight, 1e-6, torch.zeros(4, 15, device=device))
    with pytest.raises(ValueError, match="norm_weight"):
        norm_gemm(x, torch.ones(15, device=device), 1e-6, w)
    with pytest.raises(ValueError, match="residual"):
        norm_gemm(x, norm_weight, 1e-6, w, torch.zeros(3, 16, device=device))
    with pytest.raises(ValueError, match="contiguous"):
        norm_gemm(torch.zeros(16, 2, device=device).t(), norm_weight, 1e-6, w)
    with pytest.raises(ValueError, match=r"must be \[M, 2K\]"):
        silu_gemm(x, w)  # x must hold gate | up: 2 * 16 columns


def test_skinny_gemm_prologues_dispatch_to_triton_when_forced(device, monkeypatch) -> None:
    torch.manual_seed(0)
    x, residual = torch.randn(2, 48, device=device), torch.randn(2, 48, device=device)
    norm_weight, w = torch.rand(48, device=device), torch.randn(20, 48, device=device)
    gate_up = torch.randn(2, 96, device=device)

    def run_all() -> list[torch.Tensor]:
        return [fused_ops.rms_norm_skinny_gemm(x, norm_weight, 1e-6, w),
                *fused_ops.rms_norm_skinny_gemm(x, norm_weight, 1e-6, w, residual),
                fused_ops.silu_and_mul_skinny_gemm(gate_up, w)]  # fmt: skip

    monkeypatch.setenv("MYVLLM_FORCE_TRITON", "0")
    ref_out = run_all()
    monkeypatch.setenv("MYVLLM_FORCE_TRITON", "1")
    calls = []
    mod = triton_mod("skinny_gemm_kernel")
    for name in ("rms_norm_skinny_gemm_triton", "silu_and_mul_skinny_gemm_triton"):
        original = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _f=original, _n=name, **kw:
                            calls.append(_n) or _f(*a, **kw))
    tri_out = run_all()
    assert calls == ["rms_norm_skinny_gemm_triton"] * 2 + ["silu_and_mul_skinny_gemm_triton"]
    for a, b in zip(tri_out, ref_out):
        assert a.shape == b.shape
        assert_close(a, b, torch.float32)


def test_linear_takes_the_skinny_kernel_where_it_measured_faster(monkeypatch) -> None:
    """kernels.linear routes CUDA matmuls to skinny_gemm exactly where prefers_skinny_gemm
    says so (1 row, not the LM head; 2-4 rows for small matrices with outputs <= inputs),
    never on a CPU."""
    assert kernels.prefers_skinny_gemm(1, 4096, 1024)  # qkv_proj at batch 1
    assert kernels.prefers_skinny_gemm(1, 24576, 4096)  # 8B's gate_up_proj at batch 1
    assert not kernels.prefers_skinny_gemm(1, 151936, 1024)  # the LM head
    assert kernels.prefers_skinny_gemm(2, 1024, 3072)  # 0.6B's down_proj at batch 2
    assert not kernels.prefers_skinny_gemm(2, 4096, 12288)  # 8B's down_proj at batch 2
    assert kernels.prefers_skinny_gemm(4, 1024, 2048)  # 0.6B's o_proj at batch 4
    assert not kernels.prefers_skinny_gemm(4, 1024, 3072)  # 0.6B's down_proj at batch 4
    assert not kernels.prefers_skinny_gemm(2, 6144, 1024)  # gate_up_proj at batch 2
    assert not kernels.prefers_skinny_gemm(8, 1024, 2048)
    calls = []
    skinny_gemm_ref = kernels.skinny_gemm_ref
    from myvllm.kernels import linear_kernels  # where linear's GPU dispatch calls it

    monkeypatch.setattr(linear_kernels, "skinny_gemm", lambda x, w: calls.append(x.shape[0]) or
                        skinny_gemm_ref(x, w))
    w = torch.randn(4, 6)
    for rows in (1, 3, 8):
        x = torch.randn(rows, 6)
        torch.testing.assert_close(kernels.linear(x, w), x @ w.t())  # CPU: never
    assert calls == []
    if HAS_CUDA:
        for rows in (1, 3, 8):
            kernels.linear(torch.randn(rows, 6, device="cuda"), w.cuda())
        kernels.linear(torch.randn(1, 6, device="cuda"), w.cuda(), torch.zeros(4, device="cuda"))
        assert calls == [1, 3]


@pytest.mark.parametrize("first_layer", [True, False])
def test_fused_layers_compute_the_unfused_layers(device, monkeypatch, first_layer) -> None:
    """layers/fused.py: a norm fused into gate_up_proj and SiLU-and-mul into down_proj, where
    they fuse (forced here, on the interpreter on a CPU), give what RMSNorm -> linear and
    SiluAndMul -> linear give, in one kernel each; the new residual stream is the exact
    rounded sum."""
    import myvllm.layers.fused as fused
    from myvllm.layers.activation import SiluAndMul
    from myvllm.layers.layernorm import RMSNorm
    from myvllm.layers.linear import MergedColumnParallelLinear, RowParallelLinear

    torch.manual_seed(1)
    hidden, inter = 64, 96
    norm = RMSNorm(hidden).to(device)
    norm.weight.data = torch.rand(hidden, device=device) + 0.5
    gate_up_proj = MergedColumnParallelLinear(hidden, [inter, inter]).to(device)
    down_proj = RowParallelLinear(inter, hidden).to(device)
    for layer in (gate_up_proj, down_proj):
        layer.weight.data = torch.randn_like(layer.weight) / layer.weight.shape[1] ** 0.5
    x = torch.randn(1, hidden, device=device)
    residual = None if first_layer else torch.randn(1, hidden, device=device)

    monkeypatch.setenv("MYVLLM_FORCE_TRITON", "0")
    if residual is None:
        want_residual, normed = x, norm(x)
    else:
        normed, want_residual = norm(x, residual)
    want_gate_up = gate_up_proj(normed)
    want_out = down_proj(SiluAndMul()(want_gate_up))

    monkeypatch.setenv("MYVLLM_FORCE_TRITON", "1")
    monkeypatch.setattr(fused, "uses_skinny_gemm", lambda x, w, b: True)  # as on a GPU
    act_fn = SiluAndMul()
    fused.fuse(norm, gate_up_proj)
    fused.fuse(act_fn, down_proj)
    calls = []
    mod = triton_mod("skinny_gemm_kernel")
    for name in ("rms_norm_skinny_gemm_triton", "silu_and_mul_skinny_gemm_triton"):
        original = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _f=original, _n=name, **kw:
                            calls.append(_n) or _f(*a, **kw))
    if residual is None:
        new_residual, normed = x, norm(x)
    else:
        normed, new_residual = norm(x, residual)
    gate_up = gate_up_proj(normed)
    out = down_proj(act_fn(gate_up))
    assert calls == ["rms_norm_skinny_gemm_triton", "silu_and_mul_skinny_gemm_triton"]
    assert torch.equal(new_residual, want_residual)
    assert_close(gate_up, want_gate_up, torch.float32)
    assert_close(out, want_out, torch.float32)


def test_pdl_is_off_on_a_cpu_for_many_rows_and_when_switched_off(monkeypatch) -> None:
    from myvllm.kernels.pdl import PDL_MAX_ROWS, pdl_enabled, pdl_launch_args, pdl_wanted

    assert not pdl_enabled(torch.zeros(1))
    assert pdl_launch_args(False) == {}  # the interpreter's launcher knows no launch_pdl
    assert pdl_wanted(1) and pdl_wanted(PDL_MAX_ROWS) and not pdl_wanted(PDL_MAX_ROWS + 1)
    monkeypatch.setenv("MYVLLM_PDL", "0")
    assert not pdl_wanted(1)
    monkeypatch.delenv("MYVLLM_PDL")
    if HAS_CUDA:
        on_hopper = torch.cuda.get_device_capability()[0] >= 9
        assert pdl_enabled(torch.zeros(1, device="cuda")) == on_hopper
        assert not pdl_enabled(torch.zeros(PDL_MAX_ROWS + 1, device="cuda"))
        monkeypatch.setenv("MYVLLM_PDL", "0")
        assert not pdl_enabled(torch.zeros(1, device="cuda"))


@pytest.mark.skipif(not HAS_CUDA, reason="programmatic dependent launch needs a GPU")
def test_pdl_launches_give_the_same_bits(device, monkeypatch) -> None:
    """The decode-path kernels back to back, launched with PDL and without: every output
    equal to the bit (each kernel waits for the previous one before it reads its output)."""
    from myvllm.kernels.pdl import pdl_enabled

    torch.manual_seed(0)
    bf = dict(device=device, dtype=torch.bfloat16)
    hidden, heads, kv_heads, head_dim, block_size = 1024, 16, 8, 128, 16
    w_qkv = torch.randn((heads + 2 * kv_heads) * head_dim, hidden, **bf) / 32
    w_o = torch.randn(hidden, heads * head_dim, **bf) / 32
    w_gate_up, w_down = torch.randn(6144, hidden, **bf) / 32, torch.randn(hidden, 3072, **bf) / 32
    norm_w = torch.rand(hidden, **bf) + 0.5
    cos_sin = torch.randn(256, head_dim, device=device)
    k_cache = torch.randn(64, block_size, kv_heads, head_dim, **bf)
    v_cache = torch.randn_like(k_cache)
    x, residual = torch.randn(1, hidden, **bf), torch.randn(1, hidden, **bf)
    block_tables = torch.arange(8, dtype=torch.int32, device=device)[None]
    context_lens = torch.tensor([100], dtype=torch.int32, device=device)

    def step() -> list[torch.Tensor]:
        k_c, v_c = k_cache.clone(), v_cache.clone()
        qkv, res = fused_ops.rms_norm_skinny_gemm(x, norm_w, 1e-6, w_qkv, residual)
        q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
        q, k = kernels.norm_rope(q.view(1, heads, head_dim), k.view(1, kv_heads, head_dim),
                                 context_lens.long() - 1, cos_sin, norm_w[:head_dim],
                                 norm_w[:head_dim], 1e-6)
        kernels.store_kvcache(k, v.reshape(1, kv_heads, head_dim), k_c, v_c, context_lens - 1)
        o = kernels.paged_attention_decode(q, k_c, v_c, block_tables, context_lens, 0.088)
        h = kernels.skinny_gemm(o.reshape(1, -1), w_o)
        h, res = kernels.rms_norm(h, norm_w, 1e-6, res)
        gate_up = kernels.skinny_gemm(h, w_gate_up)
        out = fused_ops.silu_and_mul_skinny_gemm(gate_up, w_down)
        act = kernels.silu_and_mul(gate_up)
        return [qkv, q, k, k_c, o, h, res, gate_up, out, act]

    monkeypatch.setenv("MYVLLM_PDL", "0")
    plain = step()
    monkeypatch.delenv("MYVLLM_PDL")
    assert pdl_enabled(x) == (torch.cuda.get_device_capability()[0] >= 9)
    for a, b in zip(step(), plain):
        assert torch.equal(a, b)


# ---------------------------------------------------------------- sampling
def test_gumbel_sample_greedy_rows_are_exact_argmax(device) -> None:
    torch.manual_seed(0)
    vocab = 5000  # three chunks of 2048: the argmax may sit in any
    logits = torch.randn(4, vocab, device=device)
    logits[1, 4500] = 10.0  # in the last chunk
    logits[2, 7] = logits[2, 4200] = 10.0  # a tie across chunks: the lower id wins
    logits[3, 3000] = logits[3, 3001] = 10.0  # a tie inside a chunk
    temps = torch.zeros(4, device=device)
    seeds = torch.arange(4, device=device)
    out = triton_mod("sample_kernel").gumbel_sample_triton(logits, temps, seeds)
    assert out.dtype == torch.int64
    assert out.tolist() == logits.argmax(-1).tolist()
    assert out[2].item() == 7 and out[3].item() == 3000


@pytest.mark.slow  # 400 rows through the CPU interpreter: the longest test of this file
@pytest.mark.parametrize("chunk_size", [2048, 4])
def test_gumbel_sample_matches_softmax_distribution(device, chunk_size) -> None:
    """One chunk (2048), and three chunks of 4 tokens: a chunk, then a token inside it."""
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, 0.5, 1.5, -0.5, 1.0, 0.2, -2.0], device=device)
    temperature, n = 0.7, 400  # the interpreter runs ~60 programs (rows) per second
    temps = torch.full((n,), temperature, device=device)
    seeds = torch.arange(n, device=device) * 7919  # one seed per row, as the sampler draws
    out = triton_mod("sample_kernel").gumbel_sample_triton(logits.repeat(n, 1), temps, seeds,
                                                           chunk_size)  # fmt: skip
    freq = torch.bincount(out.cpu(), minlength=10).float() / n
    expected = torch.softmax(logits.cpu() / temperature, dim=-1)
    # The standard error is at most 0.025 here; 0.07 is ~2.8 sigma (drawn from softmax, a
    # set of seeds fails 0.6% of the time) and under two thirds of the gap to the
    # distribution without the temperature (p0 0.44 vs 0.33): that kernel fails 95% of seed
    # sets, one with the temperature applied twice 99.8%, one that picks a chunk or a token
    # inside it without its mass all of them (simulated with torch.multinomial, 4,000 sets).
    torch.testing.assert_close(freq, expected, atol=0.07, rtol=0)


def test_gumbel_sample_chunk_stats_match_torch(device) -> None:
    """The stats kernel alone: each chunk's max of logits / T and its sum of exp(x - max),
    against torch (greedy rows are scaled by 1), with a ragged last chunk."""
    mod = triton_mod("sample_kernel")
    torch.manual_seed(3)
    batch, vocab, block = 3, 20, 8
    logits = torch.randn(batch, vocab, device=device) * 2
    temps = torch.tensor([0.0, 0.5, 1.5], device=device)
    num_chunks = 3
    chunk_max = torch.empty(batch, num_chunks, device=device)
    chunk_sum = torch.empty_like(chunk_max)
    mod._chunk_stats_kernel[(batch, num_chunks)](
        logits, temps, chunk_max, chunk_sum, logits.stride(0), vocab,
        NUM_CHUNKS=num_chunks, BLOCK=block, USE_PDL=False)  # fmt: skip
    scaled = logits.cpu() / torch.tensor([1.0, 0.5, 1.5]).unsqueeze(-1)
    scaled = torch.cat([scaled, torch.full((batch, num_chunks * block - vocab), float("-inf"))], 1)
    scaled = scaled.view(batch, num_chunks, block)
    want_max = scaled.max(-1).values
    torch.testing.assert_close(chunk_max.cpu(), want_max)
    torch.testing.assert_close(chunk_sum.cpu(), (scaled - want_max.unsqueeze(-1)).exp().sum(-1))


def test_gumbel_sample_skips_tokens_of_no_mass(device) -> None:
    """-inf logits, whole chunks of them too, are never drawn."""
    logits = torch.full((64, 40), float("-inf"))
    logits[:, 21] = 0.0  # the only tokens with mass, in the third chunk of eight
    logits[:, 30] = 0.5
    out = triton_mod("sample_kernel").gumbel_sample_triton(
        logits.to(device), torch.ones(64, device=device), torch.arange(64, device=device), 8)
    assert set(out.tolist()) == {21, 30}


def test_gumbel_sample_seed_decides_the_draw(device) -> None:
    torch.manual_seed(1)
    logits = torch.randn(1, 300, device=device).repeat(6, 1)
    temps = torch.ones(6, device=device)
    kernel = triton_mod("sample_kernel").gumbel_sample_triton
    out = kernel(logits, temps, torch.tensor([5, 5, 5, 6, 7, 8], device=device), 64).tolist()
    assert out[0] == out[1] == out[2]  # same seed, same row -> same token
    assert len(set(out)) > 1  # other seeds draw other tokens somewhere (300-way choice)


def test_gumbel_sample_rejects_a_chunk_size_not_a_power_of_two(device) -> None:
    kernel = triton_mod("sample_kernel").gumbel_sample_triton
    one = torch.ones(1, device=device)
    with pytest.raises(ValueError, match="power of two"):
        kernel(torch.zeros(1, 10, device=device), one, one.long(), 6)


def test_sampler_uses_the_kernel_only_without_filters_or_seeds(device, monkeypatch) -> None:
    from myvllm.layers.sampler import Sampler

    calls = []
    mod = triton_mod("sample_kernel")
    original = mod.gumbel_sample_triton
    monkeypatch.setattr(mod, "gumbel_sample_triton", lambda *a: calls.append(1) or original(*a))
    monkeypatch.setenv("MYVLLM_FORCE_TRITON", "1")
    logits = torch.randn(3, 50, device=device)
    temps = torch.tensor([0.0, 1.0, 1.0], device=device)
    out = Sampler()(logits, temps, all_greedy=False)
    assert calls == [1] and out[0].item() == logits[0].argmax().item()
    Sampler()(logits, temps, torch.full((3,), 5, device=device), all_greedy=False)
    Sampler()(logits, temps, generators=[None, torch.Generator(device).manual_seed(0), None],
              all_greedy=False)  # fmt: skip
    assert calls == [1]  # filters or a seeded row: the PyTorch path
