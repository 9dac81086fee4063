"""layers/fused.py in whole models: the model files call their layers one by one, and where a
GPU takes the fused kernels, exactly those run, in the model's order, with the plain layers'
result. "As on a GPU" here: Triton forced (the interpreter on a CPU) and linear's skinny_gemm
rule without its is_cuda test."""

from __future__ import annotations

import importlib

import pytest
import torch
from helpers_models import prefill_context, randomize_, tiny_config

import myvllm.layers.linear as linear_mod
from myvllm.kernels import prefers_skinny_gemm
from myvllm.models.llama import LlamaForCausalLM
from myvllm.models.qwen3 import Qwen3ForCausalLM
from myvllm.utils.context import forward_context

LAYER_OPS = {"layer_ops_triton": ("rms_norm_triton", "norm_rope_triton", "silu_and_mul_triton"),
             "skinny_gemm_kernel": ("rms_norm_skinny_gemm_triton",
                                    "silu_and_mul_skinny_gemm_triton")}  # fmt: skip
FUSED_LAYER = ["rms_norm_skinny_gemm", "norm_rope", "rms_norm_skinny_gemm",
               "silu_and_mul_skinny_gemm"]  # fmt: skip
PLAIN_LAYER = ["rms_norm", "norm_rope", "rms_norm", "silu_and_mul"]


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
    monkeypatch.setattr(linear_mod, "uses_skinny_gemm", lambda x, w, b: (  # as on a GPU
        x.dim() == 2 and b is None and prefers_skinny_gemm(x.size(0), *w.shape)))
    calls: list[str] = []
    for module_name, names in LAYER_OPS.items():
        module = importlib.import_module(f"myvllm.kernels.{module_name}")
        for name in names:
            monkeypatch.setattr(module, name, lambda *a, _f=getattr(module, name), _n=name, **kw:
                                calls.append(_n.removesuffix("_triton")) or _f(*a, **kw))
    fused = forward()
    per_layer = FUSED_LAYER if rows == 1 else PLAIN_LAYER
    assert calls == per_layer * config.num_hidden_layers + ["rms_norm"]  # + model.norm
    torch.testing.assert_close(fused, plain, rtol=1e-4, atol=1e-4)
