"""What the kernel tests share: the dtypes they run in and how far Triton may be from the
torch reference on the same inputs (accumulation order only).

bf16 only on a GPU: Triton's CPU interpreter computes bf16 dot products wrongly."""

from __future__ import annotations

import math

import torch

from myvllm.kernels import store_kvcache_ref
from myvllm.kernels.fp8_kv_reference import FP8_DTYPE

HAS_CUDA = torch.cuda.is_available()
DTYPES = [torch.float16, torch.float32] + ([torch.bfloat16] if HAS_CUDA else [])
TOL = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}

# The fp8 tests' scales are not 1.0 (vLLM's default, and ours), so that a kernel that forgets
# to divide or multiply by its scale fails instead of passing by luck.
K_SCALE, V_SCALE = 0.37, 1.9
NAN_BYTE = 0x7F  # e4m3fn's NaN: unused cache slots hold it, so a read of one shows


def paged_caches(k: torch.Tensor, v: torch.Tensor, lengths: list[int], block_size: int,
                 cache_dtype: torch.dtype, spare_blocks: int = 3
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """K/V [sum(lengths), Hkv, D] stored by store_kvcache_ref (fp8: with K_SCALE, V_SCALE) into
    a cache of shuffled blocks; unused slots hold NaN. -> (k_cache, v_cache, block_tables)."""
    gen = torch.Generator().manual_seed(1234)
    per_seq = [math.ceil(n / block_size) for n in lengths]
    num_blocks = sum(per_seq) + spare_blocks
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.full((len(lengths), max(max(per_seq), 1) + 1), -1, dtype=torch.int32)
    slots = []
    for b, n in enumerate(lengths):
        blocks = [order.pop() for _ in range(per_seq[b])]
        tables[b, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(n)]
    shape = (num_blocks, block_size, k.shape[1], k.shape[2])
    if cache_dtype == FP8_DTYPE:
        k_cache = torch.full(shape, NAN_BYTE, dtype=torch.uint8, device=k.device).view(FP8_DTYPE)
    else:
        k_cache = torch.full(shape, float("nan"), dtype=cache_dtype, device=k.device)
    v_cache = k_cache.clone()
    slot_mapping = torch.tensor(slots, dtype=torch.int32, device=k.device)
    store_kvcache_ref(k, v, k_cache, v_cache, slot_mapping, K_SCALE, V_SCALE)
    return k_cache, v_cache, tables.to(k.device)
