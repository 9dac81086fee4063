"""The fp8 KV cache (Config.kv_cache_dtype="fp8") in the three attention kernels.

- The PyTorch references: store_kvcache_ref writes fp8(clamp(x / scale, -448, 448)) per slot
  (checked against a loop over torch's own cast), and both attention references read it
  back as stored * scale.
- The Triton kernels against those references on the same fp8 cache: the store bit for bit,
  prefill and decode within float accumulation (the same tolerances as with a model-dtype
  cache). Then attention over the fp8 cache against attention over the full-precision cache:
  within fp8's rounding (3 mantissa bits), and far outside it if a scale is dropped.

The scales in these tests are not 1.0 (vLLM's default, and ours), so that a kernel that
forgets to divide or multiply by its scale fails instead of passing by luck.

Triton's CPU interpreter reads fp8 correctly but rounds float -> fp8 wrongly (it truncates
subnormals and drops the carry when the mantissa rounds up, e.g. 7.93 -> 4.0); the GPU rounds
to nearest even (cvt.rn), as torch does. The `exact_fp8_casts` fixture gives the interpreter
torch's cast, so the interpreted store kernel is checked for everything but the cast
instruction itself, which tests/gpu/test_gpu_fp8_kv_cache.py checks on the GPU.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import numpy as np
import pytest
import torch
from helpers_kernels import DTYPES, HAS_CUDA, K_SCALE, TOL, V_SCALE, paged_caches

from myvllm.kernels import (
    flash_attention_varlen_ref,
    paged_attention_decode_ref,
    store_kvcache_ref,
)
from myvllm.kernels.fp8_kv_reference import FP8_DTYPE, FP8_MAX, dequantize_kv, quantize_kv

# fp8 e4m3 keeps 3 mantissa bits: each element is off by up to 1/16 of its value, and the
# output of attention over N(0, 1) keys and values by 2.6-3.8% in norm (these shapes, three
# seeds); reading the same cache without its scales (K_SCALE, V_SCALE) is off by 48-59%.
FP8_REL_TOL = 0.05


@pytest.fixture(scope="module")
def device() -> torch.device:
    pytest.importorskip("triton")
    return torch.device("cuda" if HAS_CUDA else "cpu")


@pytest.fixture
def exact_fp8_casts(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU interpreter, float32 -> fp8 e4m3 casts go through torch (see the module
    docstring); on a GPU nothing changes."""
    if HAS_CUDA:
        return
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter.InterpreterBuilder.create_fp_to_fp

    def create_fp_to_fp(self, src, dst_type, rounding_mode):  # type: ignore[no-untyped-def]
        if dst_type.scalar != tl.float8e4nv or src.data.dtype != np.float32:
            return original(self, src, dst_type, rounding_mode)
        fp8 = torch.from_numpy(np.ascontiguousarray(src.data)).to(FP8_DTYPE)
        return interpreter.TensorHandle(fp8.view(torch.uint8).numpy(), dst_type.scalar)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_fp_to_fp", create_fp_to_fp)


def triton_mod(name: str) -> ModuleType:
    return importlib.import_module(f"myvllm.kernels.{name}")


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.float() - ref.float()).norm() / ref.float().norm()).item()


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.uint8)


def cu_seqlens(lengths: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor([0] + [sum(lengths[: i + 1]) for i in range(len(lengths))],
                        dtype=torch.int32, device=device)  # fmt: skip


# --------------------------------------------------------------------------- the oracle


def test_store_kvcache_ref_quantizes_each_slot_like_torch() -> None:
    key, value = torch.randn(6, 2, 8) * 50, torch.randn(6, 2, 8)
    key[0, 0, 0], key[2, 1, 3] = 1e4, -1e4  # beyond fp8's range / K_SCALE: must saturate
    slots = torch.tensor([5, -1, 0, 17, -1, 9], dtype=torch.int32)
    shape = (3, 8, 2, 8)
    k_cache = torch.zeros(shape, dtype=FP8_DTYPE)
    v_cache = torch.zeros(shape, dtype=FP8_DTYPE)
    store_kvcache_ref(key, value, k_cache, v_cache, slots, K_SCALE, V_SCALE)
    k_loop, v_loop = torch.zeros(shape), torch.zeros(shape)
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            k_loop[s // 8, s % 8] = (key[i] / K_SCALE).clamp(-448, 448)
            v_loop[s // 8, s % 8] = value[i] / V_SCALE
    assert torch.equal(bits(k_cache), bits(k_loop.to(FP8_DTYPE)))
    assert torch.equal(bits(v_cache), bits(v_loop.to(FP8_DTYPE)))
    assert dequantize_kv(k_cache, K_SCALE)[0, 5, 0, 0] == torch.tensor(FP8_MAX) * K_SCALE
    assert not torch.isnan(dequantize_kv(k_cache, K_SCALE)).any()


def test_quantize_round_trip_is_within_fp8_rounding() -> None:
    x = torch.randn(4096) * 3
    back = dequantize_kv(quantize_kv(x, FP8_DTYPE, K_SCALE), K_SCALE)
    normal = (x / K_SCALE).abs() >= 2**-6  # below, e4m3 is subnormal: absolute steps
    # Round to nearest with 3 mantissa bits: at most half a step, 1/16 of the value.
    assert ((back - x).abs()[normal] <= x.abs()[normal] / 16 + 1e-7).all()
    assert ((back - x).abs()[~normal] <= 2**-10 * K_SCALE + 1e-7).all()
    # A cache of the model's dtype: a plain cast, no scale.
    assert torch.equal(quantize_kv(x, torch.float32, K_SCALE), x)
    assert torch.equal(dequantize_kv(x.half(), K_SCALE), x.half().float())


# --------------------------------------------------------------------------- Triton


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scales", [(1.0, 1.0), (K_SCALE, V_SCALE)])
def test_store_kvcache_triton_fp8_bits_equal_the_reference(device, exact_fp8_casts, dtype,
                                                           scales) -> None:  # fmt: skip
    n, block_size, num_kv_heads, head_dim = 9, 16, 2, 24
    num_blocks = 3
    wide = (torch.randn(n, 3, num_kv_heads, head_dim) * 20).to(device, dtype)
    wide[0, 1, 0, :3] = torch.tensor([1000.0, -1000.0, 1e-4])  # saturation, a subnormal
    key, value = wide[:, 1], wide[:, 2]  # strided views, as the attention layer passes them
    slots = torch.randperm(num_blocks * block_size)[:n].int()
    slots[[1, 4]] = -1  # padding tokens
    slots = slots.to(device)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.zeros(shape, dtype=FP8_DTYPE, device=device)
    v_cache = torch.zeros_like(k_cache)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    triton_mod("store_kvcache_kernel").store_kvcache_triton(key, value, k_cache, v_cache, slots,
                                                            *scales)
    store_kvcache_ref(key, value, k_ref, v_ref, slots, *scales)
    assert torch.equal(bits(k_cache), bits(k_ref)) and torch.equal(bits(v_cache), bits(v_ref))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_norm", [False, True])
def test_norm_rope_store_kvcache_triton_fp8_bits_equal_the_reference(device, exact_fp8_casts,
                                                                     dtype, with_norm) -> None:
    """The store fused into norm+RoPE quantizes as store_kvcache does: the cache's bits are
    store_kvcache_ref's from the rotated k and from v, with the layer's scales."""
    n, block_size, num_q_heads, num_kv_heads, head_dim = 9, 16, 4, 2, 24
    num_blocks = 3
    wide = (torch.randn(n, num_q_heads + 2 * num_kv_heads, head_dim) * 20).to(device, dtype)
    wide[0, num_q_heads + num_kv_heads, :3] = torch.tensor([1000.0, -1000.0, 1e-4])  # v
    q, k = wide[:, :num_q_heads], wide[:, num_q_heads:num_q_heads + num_kv_heads]
    v = wide[:, num_q_heads + num_kv_heads:]
    weights = [(1 + torch.randn(head_dim) * 0.1).to(device, dtype) if with_norm else None
               for _ in range(2)]  # fmt: skip
    inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim)
    freqs = torch.outer(torch.arange(64).float(), inv_freq)
    table = torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(device)
    positions = torch.randint(0, 64, (n,), device=device)
    slots = torch.randperm(num_blocks * block_size)[:n].int()
    slots[[1, 4]] = -1  # padding tokens
    slots = slots.to(device)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.zeros(shape, dtype=FP8_DTYPE, device=device)
    v_cache = torch.zeros_like(k_cache)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    _, k_out = triton_mod("layer_ops_triton").norm_rope_store_kvcache_triton(
        q, k, v, positions, table, k_cache, v_cache, slots, *weights, 1e-6, K_SCALE, V_SCALE)
    store_kvcache_ref(k_out, v, k_ref, v_ref, slots, K_SCALE, V_SCALE)
    assert torch.equal(bits(k_cache), bits(k_ref)) and torch.equal(bits(v_cache), bits(v_ref))
    assert bits(k_cache).any() and bits(v_cache).any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_paged_attention_decode_triton_reads_an_fp8_cache(device, dtype, num_splits) -> None:
    num_heads, num_kv_heads, head_dim, block_size = 4, 2, 32, 16
    lengths = [1, 45, 0, 17]  # 0 = a padding row (as in a CUDA-graph batch)
    k = torch.randn(sum(lengths), num_kv_heads, head_dim).to(device, dtype)
    v = torch.randn(sum(lengths), num_kv_heads, head_dim).to(device, dtype)
    q = torch.randn(len(lengths), num_heads, head_dim).to(device, dtype)
    ctx = torch.tensor(lengths, dtype=torch.int32, device=device)
    k_fp8, v_fp8, tables = paged_caches(k, v, lengths, block_size, FP8_DTYPE)
    k_full, v_full, _ = paged_caches(k, v, lengths, block_size, dtype)
    scale = head_dim**-0.5
    out = triton_mod("decode_attention").paged_attention_decode_triton(
        q, k_fp8, v_fp8, tables, ctx, scale, num_splits=num_splits, k_scale=K_SCALE,
        v_scale=V_SCALE)
    ref = paged_attention_decode_ref(q, k_fp8, v_fp8, tables, ctx, scale, K_SCALE, V_SCALE)
    full = paged_attention_decode_ref(q, k_full, v_full, tables, ctx, scale)
    assert not torch.isnan(out).any()
    assert (out.float() - ref.float()).abs().max().item() <= TOL[dtype]
    assert rel_err(out, full) < FP8_REL_TOL
    assert torch.equal(out[2], torch.zeros_like(out[2]))  # empty context -> zeros
    # The oracle can fail: the same cache read without its scales is far off.
    unscaled = paged_attention_decode_ref(q, k_fp8, v_fp8, tables, ctx, scale)
    assert rel_err(unscaled, full) > 5 * FP8_REL_TOL


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("use_tile_map", [False, True])
def test_flash_attention_varlen_triton_reads_an_fp8_prefix(device, dtype, use_tile_map) -> None:
    """A cached prefix read from an fp8 cache, on the plain grid and on a tile map's fixed
    grid (a chunked step's CUDA graph) with a tile cut along its keys."""
    from myvllm.kernels import tile_map

    mod = triton_mod("prefill_attention")
    num_heads, num_kv_heads, head_dim, block_size = 4, 2, 16, 4
    cfg = mod.prefill_config(device, head_dim, dtype)
    lengths_k = [21 + 3 * cfg.block_n, 3, 40]  # whole context: cached prefix + new tokens
    lengths_q = [21, 3, 19]  # new tokens (sequence 1 has no cached prefix)
    k = torch.randn(sum(lengths_k), num_kv_heads, head_dim).to(device, dtype)
    v = torch.randn(sum(lengths_k), num_kv_heads, head_dim).to(device, dtype)
    q = torch.randn(sum(lengths_q), num_heads, head_dim).to(device, dtype)
    k_fp8, v_fp8, tables = paged_caches(k, v, lengths_k, block_size, FP8_DTYPE)
    k_full, v_full, _ = paged_caches(k, v, lengths_k, block_size, dtype)
    cu_q, cu_k = cu_seqlens(lengths_q, device), cu_seqlens(lengths_k, device)
    head = (q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), 0.25, tables)
    the_map = None
    if use_tile_map:
        num_parts = 8
        slots = tile_map.tile_map_slots(sum(lengths_q), max_num_seqs=8, block_m=cfg.block_m,
                                        num_parts=num_parts)
        rows, combine = tile_map.build_tile_map(lengths_q, lengths_k, cfg.block_m, cfg.block_n,
                                                slots, num_parts, split_key_tiles=1)
        assert combine[0] != -1  # a tile was split: the combine kernel runs too
        the_map = tile_map.TileMap(
            torch.tensor(rows, dtype=torch.int32, device=device).view(-1, 5),
            torch.tensor(combine, dtype=torch.int32, device=device).view(-1, 4), num_parts)
    out = mod.flash_attention_varlen_triton(*head, k_fp8, v_fp8, the_map, k_scale=K_SCALE,
                                            v_scale=V_SCALE)
    ref = flash_attention_varlen_ref(*head, k_fp8, v_fp8, K_SCALE, V_SCALE)
    full = flash_attention_varlen_ref(*head, k_full, v_full)
    assert (out.float() - ref.float()).abs().max().item() <= TOL[dtype]
    assert rel_err(out, full) < FP8_REL_TOL
    unscaled = flash_attention_varlen_ref(*head, k_fp8, v_fp8)
    assert rel_err(unscaled, full) > 5 * FP8_REL_TOL
