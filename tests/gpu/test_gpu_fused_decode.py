"""The decode step's fused kernels on the GPU, in the whole engine (skipped without CUDA).

Run on a GPU machine with `PYTHONPATH=src python3 -m pytest tests/gpu/test_gpu_fused_decode.py -q`.

- RoPE and the KV store in one kernel (layers/fused.py: rotary_emb left to the attention
  layer's store, fused_ops.norm_rope_store_kvcache): Qwen3-0.6B's shape with dummy weights,
  under CUDA graphs, gives the greedy tokens of the same engine built without that pair, for
  a bf16 and an fp8 cache. The fused kernel computes the bits of the two it replaces, so the
  tokens are equal, not just close.

Kernel counts are not asserted here: docs/diagnostics/decode_launches.py prints them.
"""

from __future__ import annotations

import gc
import random
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

QWEN3_CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs" / "Qwen3-0.6B"
ENGINE_ARGS = dict(load_format="dummy", max_model_length=1024, max_num_batched_tokens=4096,
                   num_kvcache_blocks=2048, max_num_sequences=16)
STORE_PAIR = ("rotary_emb", "attn")


def greedy_tokens(monkeypatch: pytest.MonkeyPatch, fuse_store: bool, kv_cache_dtype: str,
                  prompts: list[list[int]]) -> tuple[list[list[int]], dict[str, int]]:
    """The greedy tokens of a fresh CUDA-graph engine, and how often each store kernel was
    called (while the graphs were captured, and in the eager prefills)."""
    import myvllm.kernels.layer_ops_triton as layer_ops
    import myvllm.kernels.store_kvcache_kernel as store_kernel
    import myvllm.layers.fused as fused
    from myvllm import LLM, SamplingParams

    with monkeypatch.context() as patch:
        if not fuse_store:
            patch.setattr(fused, "FUSED_PAIRS", tuple(p for p in fused.FUSED_PAIRS
                                                      if p != STORE_PAIR))  # fmt: skip
        calls = {"fused": 0, "separate": 0}
        for module, name, key in ((layer_ops, "norm_rope_store_kvcache_triton", "fused"),
                                  (store_kernel, "store_kvcache_triton", "separate")):
            patch.setattr(module, name, lambda *a, _f=getattr(module, name), _k=key, **kw:
                          calls.__setitem__(_k, calls[_k] + 1) or _f(*a, **kw))
        llm = LLM(str(QWEN3_CONFIG_DIR), kv_cache_dtype=kv_cache_dtype, **ENGINE_ARGS)
        try:
            assert llm.model_runner.graphs.sizes("decode")
            params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
            tokens = [[o["token_ids"] for o in llm.generate(batch, params, use_tqdm=False)]
                      for batch in (prompts[:1], prompts)]  # fmt: skip
        finally:
            llm.exit()
            del llm
            gc.collect()
            torch.cuda.empty_cache()
    return tokens[0] + tokens[1], calls


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_rope_with_the_kv_store_gives_the_unfused_tokens(monkeypatch: pytest.MonkeyPatch,
                                                         kv_cache_dtype: str) -> None:
    rng = random.Random(7)
    prompts = [[rng.randint(0, 150000) for _ in range(n)] for n in (128, 5, 300, 17, 64)]
    fused, fused_calls = greedy_tokens(monkeypatch, True, kv_cache_dtype, prompts)
    plain, plain_calls = greedy_tokens(monkeypatch, False, kv_cache_dtype, prompts)
    assert fused_calls["fused"] > 0 and fused_calls["separate"] == 0, fused_calls
    assert plain_calls["fused"] == 0 and plain_calls["separate"] > 0, plain_calls
    assert fused == plain
