"""layers/fused.py in whole models: the model files call their layers one by one, and where a
GPU takes the fused kernels, exactly those run, in the model's order, with the plain layers'
result. "As on a GPU" here: the model fused as build_model fuses one built on a GPU
(fuse_layer_ops), Triton forced (the interpreter on a CPU) and the fused linear layers'
skinny_gemm rule without its is_cuda test. A model built on a CPU is not fused: it runs the
plain layers' kernels whatever Triton does."""

from __future__ import annotations

import importlib

import pytest
import torch
from helpers_models import prefill_context, randomize_, tiny_config

import myvllm.layers.fused as fused_mod
from myvllm.kernels import prefers_skinny_gemm
from myvllm.layers.fused import FUSED_VARIANTS, fuse_layer_ops
from myvllm.models.llama import LlamaForCausalLM
from myvllm.models.qwen3 import Qwen3ForCausalLM
from myvllm.utils.context import forward_context

LAYER_OPS = {"layer_ops_triton": ("rms_norm_triton", "norm_rope_triton", "silu_and_mul_triton"),
             "skinny_gemm_kernel": ("rms_norm_skinny_gemm_triton",
                                    "silu_and_mul_skinny_gemm_triton")}  # fmt: skip
FUSED_LAYER = ["rms_norm_skinny_gemm", "norm_rope", "rms_norm_skinny_gemm",
               "silu_and_mul_skinny_gemm"]  # fmt: skip
PLAIN_LAYER = ["rms_norm", "norm_rope", "rms_norm", "silu_and_mul"]
# Not fused at all: Qwen3's q_norm and k_norm run on their own too.
UNFUSED_LAYER = {Qwen3ForCausalLM: ["rms_norm", "rms_norm", "rms_norm", "norm_rope", "rms_norm",
                                    "silu_and_mul"],
                 LlamaForCausalLM: PLAIN_LAYER}  # fmt: skip


def record_kernels(monkeypatch: pytest.MonkeyPatch, kernels: dict[str, tuple[str, ...]]
                   ) -> list[str]:  # fmt: skip
    """The names of these Triton kernels, in the order they are called from now on."""
    calls: list[str] = []
    for module_name, names in kernels.items():
        module = importlib.import_module(f"myvllm.kernels.{module_name}")
        for name in names:
            monkeypatch.setattr(module, name, lambda *a, _f=getattr(module, name), _n=name, **kw:
                                calls.append(_n.removesuffix("_triton")) or _f(*a, **kw))
    return calls


@pytest.mark.parametrize("model_class", [Qwen3ForCausalLM, LlamaForCausalLM])
@pytest.mark.parametrize("rows", [1, 5])
def test_the_fused_kernels_run_where_a_gpu_runs_them(monkeypatch, model_class, rows) -> None:
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("CPU test: on a GPU the engine's own runs show the kernels")
    config = tiny_config("qwen3" if model_class is Qwen3ForCausalLM else "llama")
    model = model_class(config).eval()
    randomize_(model, seed=1)
    ids, positions = torch.arange(rows) + 3, torch.arange(rows)

    def forward() -> torch.Tensor:
        with torch.no_grad(), forward_context(prefill_context([rows])):
            return model(ids, positions)

    monkeypatch.setenv("MYVLLM_FORCE_TRITON", "0")
    plain = forward()
    monkeypatch.setenv("MYVLLM_FORCE_TRITON", "1")
    monkeypatch.setattr(fused_mod, "uses_skinny_gemm", lambda x, w, b: (  # as on a GPU
        x.dim() == 2 and b is None and prefers_skinny_gemm(x.size(0), *w.shape)))
    calls = record_kernels(monkeypatch, LAYER_OPS)
    unfused = forward()  # as built on a CPU: no module is a fused variant
    assert not any(type(m) in FUSED_VARIANTS.values() for m in model.modules())
    assert calls == UNFUSED_LAYER[model_class] * config.num_hidden_layers + ["rms_norm"]
    calls.clear()
    fuse_layer_ops(model)  # as build_model does on a GPU
    fused = forward()
    per_layer = FUSED_LAYER if rows == 1 else PLAIN_LAYER
    assert calls == per_layer * config.num_hidden_layers + ["rms_norm"]  # + model.norm
    torch.testing.assert_close(unfused, plain, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(fused, plain, rtol=1e-4, atol=1e-4)
    monkeypatch.setenv("MYVLLM_FORCE_TRITON", "0")  # the fused model on the references
    calls.clear()
    torch.testing.assert_close(forward(), plain, rtol=1e-4, atol=1e-4)
    assert calls == []


@pytest.mark.parametrize("model_class", [Qwen3ForCausalLM, LlamaForCausalLM])
def test_rope_and_the_kv_store_are_one_kernel_where_there_is_a_cache(monkeypatch,
                                                                      model_class) -> None:
    """With a KV cache to write, RoPE (and Qwen3's q/k norms) run inside the attention layer's
    store, norm_rope_store_kvcache, instead of norm_rope then store_kvcache: a prefill of 2
    tokens, then a decode step of one row and one padding row (slot -1, nothing written) give
    the plain layers' hidden states and write the caches the plain layers write."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("CPU test: on a GPU the engine's own runs show the kernels")
    from myvllm.layers.attention import Attention
    from myvllm.utils.context import Context

    config = tiny_config("qwen3" if model_class is Qwen3ForCausalLM else "llama")
    model = model_class(config).eval()
    randomize_(model, seed=2)
    fuse_layer_ops(model)  # as build_model does on a GPU
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    block_size, num_blocks = 4, 3
    prefill = prefill_context([2], torch.tensor([8, 9], dtype=torch.int32))
    # The decode batch padded to 2 rows, as for a CUDA graph: the padding row has slot -1.
    decode = Context(is_prefill=False, slot_mapping=torch.tensor([10, -1], dtype=torch.int32),
                     context_lens=torch.tensor([3, 0], dtype=torch.int32),
                     block_tables=torch.tensor([[2, 1, -1], [-1, -1, -1]], dtype=torch.int32))

    def run() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        for layer in layers:  # fresh caches, NaN where nothing is written
            shape = (num_blocks, block_size, layer.num_kv_heads, layer.head_dim)
            layer.k_cache = torch.full(shape, float("nan"))
            layer.v_cache = torch.full(shape, float("nan"))
        outs = []
        for context, ids, positions in ((prefill, [3, 4], [0, 1]), (decode, [6, 0], [2, 0])):
            with torch.no_grad(), forward_context(context):
                outs.append(model(torch.tensor(ids), torch.tensor(positions)))
        return outs, [c for layer in layers for c in (layer.k_cache, layer.v_cache)]

    monkeypatch.setenv("MYVLLM_FORCE_TRITON", "0")
    plain_out, plain_caches = run()
    monkeypatch.setenv("MYVLLM_FORCE_TRITON", "1")
    calls = record_kernels(monkeypatch, {
        "layer_ops_triton": ("norm_rope_triton", "norm_rope_store_kvcache_triton"),
        "store_kvcache_kernel": ("store_kvcache_triton",)})  # fmt: skip
    fused_out, fused_caches = run()
    assert calls == ["norm_rope_store_kvcache"] * (2 * config.num_hidden_layers)
    for got, want in zip(fused_out, plain_out):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for got, want in zip(fused_caches, plain_caches):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, equal_nan=True)
        assert got.isnan().sum() == want.isnan().sum() == got.numel() - 3 * got[0, 0].numel()
