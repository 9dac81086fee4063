"""The decode kernel's two programs for the scores (decode_attention.DECODE_SCORES) against
the PyTorch reference: "dot" (the query heads of a kv head padded to 16 rows for tl.dot) and
"cuda_cores" (decode_attention.py's CUDA-core program: products summed on the CUDA cores over the real heads,
one online softmax per tile row, the scales folded into the queries and the output).

GQA groups 1, 2, 4 and 8 query heads a kv head (8: past the CUDA-core program's limit, so
both values of the switch run the dot), head dims 64 and 128, a 16-bit and an fp8 cache
(scales not 1.0), contexts that end inside a block, inside a tile and on a tile's edge, an
empty one (a padding row: zeros), one split and three. fp16 and fp32 on the CPU interpreter
(its bf16 dot is wrong); on a GPU bf16 too.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from helpers_kernels import DTYPES, HAS_CUDA, K_SCALE, TOL, V_SCALE, paged_caches

from myvllm.kernels import paged_attention_decode_ref
from myvllm.kernels.fp8_kv_reference import FP8_DTYPE

LENGTHS = [1, 45, 0, 16, 130]  # 45 and 130 end inside a 16-token block, 16 on its edge
NUM_KV_HEADS, BLOCK_SIZE = 2, 16


@pytest.fixture(scope="module")
def decode() -> object:
    pytest.importorskip("triton")
    return importlib.import_module("myvllm.kernels.decode_attention")


def device() -> torch.device:
    return torch.device("cuda" if HAS_CUDA else "cpu")


def check(decode, scores: str, group: int, head_dim: int, cache_dtype: torch.dtype | None,
          dtype: torch.dtype, num_splits: int, config: object = None) -> None:
    """One call against the reference on the same cache (cache_dtype None: the query dtype)."""
    torch.manual_seed(group * head_dim + num_splits)
    dev = device()
    k = torch.randn(sum(LENGTHS), NUM_KV_HEADS, head_dim).to(dev, dtype)
    v = torch.randn(sum(LENGTHS), NUM_KV_HEADS, head_dim).to(dev, dtype)
    q = torch.randn(len(LENGTHS), group * NUM_KV_HEADS, head_dim).to(dev, dtype)
    fp8 = cache_dtype == FP8_DTYPE
    k_cache, v_cache, tables = paged_caches(k, v, LENGTHS, BLOCK_SIZE, cache_dtype or dtype)
    scales = (K_SCALE, V_SCALE) if fp8 else (1.0, 1.0)
    ctx = torch.tensor(LENGTHS, dtype=torch.int32, device=dev)
    scale = head_dim**-0.5
    out = decode.paged_attention_decode_triton(q, k_cache, v_cache, tables, ctx, scale,
                                               num_splits=num_splits, k_scale=scales[0],
                                               v_scale=scales[1], scores=scores, config=config)
    ref = paged_attention_decode_ref(q, k_cache, v_cache, tables, ctx, scale, *scales)
    assert not torch.isnan(out).any()
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= TOL[dtype], f"max abs error {err} > {TOL[dtype]}"
    assert torch.equal(out[2], torch.zeros_like(out[2]))  # empty context -> zeros


@pytest.mark.parametrize("scores", ["dot", "cuda_cores"])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("cache_dtype", [None, FP8_DTYPE], ids=["16-bit", "fp8"])
def test_both_programs_match_the_reference(decode, scores, group, cache_dtype) -> None:
    for num_splits in (1, 3):
        check(decode, scores, group, 64, cache_dtype, torch.float16, num_splits)


@pytest.mark.parametrize("scores", ["dot", "cuda_cores"])
@pytest.mark.parametrize("cache_dtype", [None, FP8_DTYPE], ids=["16-bit", "fp8"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_head_dim_128_in_every_dtype(decode, scores, cache_dtype, dtype) -> None:
    check(decode, scores, 2, 128, cache_dtype, dtype, 1)


@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("cache_dtype", [None, FP8_DTYPE], ids=["16-bit", "fp8"])
def test_cuda_cores_with_two_keys_a_row(decode, group, cache_dtype) -> None:
    """keys_per_row 2: each state row meets two keys an iteration (two 16-key tiles)."""
    config = decode.DecodeConfig(block_n=32, num_warps=4, num_stages=1, keys_per_row=2)
    for num_splits in (1, 3):
        check(decode, "cuda_cores", group, 64, cache_dtype, torch.float16, num_splits, config)


def test_the_switch_picks_the_program(decode, monkeypatch) -> None:
    """DECODE_SCORES is read at every call; "auto" follows AUTO_CUDA_CORES_MAX_GROUP; groups
    past the CUDA-core program's limit always take the dot; an unknown value is refused."""
    uses = decode.uses_cuda_cores
    assert uses("cuda_cores", 2, torch.bfloat16) and not uses("dot", 2, FP8_DTYPE)
    assert not uses("cuda_cores", 8, FP8_DTYPE)  # past decode_attention.CUDA_CORES_MAX_GROUP
    monkeypatch.setattr(decode, "AUTO_CUDA_CORES_MAX_GROUP", {1: 4, 2: 1})
    assert uses("auto", 4, FP8_DTYPE) and not uses("auto", 8, FP8_DTYPE)
    assert uses("auto", 1, torch.float16) and not uses("auto", 2, torch.float16)
    assert not uses("auto", 1, torch.float32)  # not in the table: the dot
    with pytest.raises(ValueError, match="allowed: auto, dot, cuda_cores"):
        uses("tensor_cores", 2, FP8_DTYPE)
    launched: list[str] = []
    for name in ("_paged_decode_split_kernel", "paged_decode_cuda_cores_kernel"):
        monkeypatch.setattr(decode, name, _Recorder(name, launched))
    q = torch.zeros(1, 4, 16, device=device())
    cache = torch.zeros(1, 16, 2, 16, device=device())
    args = (q, cache, cache, torch.zeros(1, 1, dtype=torch.int32, device=device()),
            torch.ones(1, dtype=torch.int32, device=device()), 1.0)
    for value in ("dot", "cuda_cores"):
        monkeypatch.setattr(decode, "DECODE_SCORES", value)
        decode.paged_attention_decode_triton(*args, num_splits=1)
    assert launched == ["_paged_decode_split_kernel", "paged_decode_cuda_cores_kernel"]
    monkeypatch.setattr(decode, "DECODE_SCORES", "fast")
    with pytest.raises(ValueError, match="allowed:"):
        decode.paged_attention_decode_triton(*args)


class _Recorder:
    """Stands in for a Triton kernel: kernel[grid](...) records the kernel's name."""

    def __init__(self, name: str, launched: list[str]) -> None:
        self.name, self.launched = name, launched

    def __getitem__(self, grid: object) -> object:
        return lambda *args, **kwargs: self.launched.append(self.name)
