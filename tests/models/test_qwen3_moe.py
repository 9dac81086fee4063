"""Qwen3-MoE against transformers' Qwen3MoeForCausalLM on the tiny random checkpoint
(helpers_models "qwen3_moe": layer 0 dense, layers 1-2 with 8 experts, top-2).

tests/models/test_models_vs_hf.py compares the logits (batched prefill, a cached prefix,
decode steps); here: which layers have experts, the router, the experts' loading (names,
strictness, tensor-parallel shards) and the engine's greedy tokens, with a prefix hit and
under tensor parallelism 2 over gloo.
"""

from __future__ import annotations

import multiprocessing
import shutil
from pathlib import Path

import pytest
import torch
from helpers_models import hf_greedy, load_hf_reference, load_ours, random_prompts
from helpers_models import tiny_checkpoint, tiny_config
from safetensors.torch import load_file, save_file

import myvllm.layers.fused_moe as fused_moe_layer
from myvllm import LLM, SamplingParams
from myvllm.layers.fused_moe import FusedMoE, select_experts
from myvllm.models.decoder import GatedMLP
from myvllm.models.qwen3_moe import Qwen3MoeSparseMoeBlock, is_sparse_layer
from myvllm.utils.checkpoint import CheckpointError

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
ENGINE = dict(block_size=4, num_kvcache_blocks=64, max_model_length=64,
              max_num_batched_tokens=128)  # fmt: skip


@pytest.mark.parametrize("mlp_only_layers,step", [([0], 1), ([], 2), ([1, 4], 3), ([], 1)])
def test_sparse_layers_are_transformers_layers(mlp_only_layers: list[int], step: int) -> None:
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3_moe import modeling_qwen3_moe as hf

    config = tiny_config("qwen3_moe", num_hidden_layers=6, mlp_only_layers=mlp_only_layers,
                         decoder_sparse_step=step)  # fmt: skip
    hf_layers = AutoModelForCausalLM.from_config(config).model.layers
    want = [isinstance(layer.mlp, hf.Qwen3MoeSparseMoeBlock) for layer in hf_layers]
    assert want == [is_sparse_layer(config, i) for i in range(6)]
    ours = load_ours_structure(config)
    assert [isinstance(m.mlp, Qwen3MoeSparseMoeBlock) for m in ours.model.layers] == want
    assert all(isinstance(m.mlp, GatedMLP) for m, sparse in zip(ours.model.layers, want)
               if not sparse)  # fmt: skip


def load_ours_structure(config) -> torch.nn.Module:
    from myvllm.models.qwen3_moe import Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM(config)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_router_picks_transformers_experts_and_weights(norm_topk_prob: bool) -> None:
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    config = tiny_config("qwen3_moe", norm_topk_prob=norm_topk_prob, num_experts_per_tok=3)
    router = Qwen3MoeTopKRouter(config)
    torch.nn.init.normal_(router.weight)
    x = torch.randn(13, config.hidden_size)
    logits, hf_weights, hf_ids = router(x)
    weights, ids = select_experts(logits, config.num_experts_per_tok, norm_topk_prob)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(weights, hf_weights.float(), atol=1e-7, rtol=0)
    assert torch.allclose(weights.sum(-1), torch.ones(13)) == norm_topk_prob


def test_missing_or_extra_expert_is_named(tmp_path: Path) -> None:
    src = tiny_checkpoint("qwen3_moe")
    for case in ("missing", "extra"):
        dst = tmp_path / case
        shutil.copytree(src, dst)
        tensors = load_file(dst / "model.safetensors")
        if case == "missing":
            del tensors["model.layers.2.mlp.experts.5.up_proj.weight"]
            match = r"missing.*model\.layers\.2\.mlp\.experts\.5\.up_proj\.weight"
        else:
            tensors["model.layers.1.mlp.experts.8.down_proj.weight"] = (
                tensors["model.layers.1.mlp.experts.0.down_proj.weight"].clone())
            match = r"unexpected.*model\.layers\.1\.mlp\.experts\.8\.down_proj\.weight"
        save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
        with pytest.raises(CheckpointError, match=match):
            load_ours(dst)


def test_expert_shards_of_two_ranks_make_the_full_experts(monkeypatch) -> None:
    """Each rank's w13/w2 hold its slice of every expert's intermediate dimension; the two
    slices side by side are the checkpoint's gate, up and down matrices."""
    tensors = load_file(tiny_checkpoint("qwen3_moe") / "model.safetensors")
    prefix = "model.layers.1.mlp.experts"
    layers = []
    for rank in range(2):
        monkeypatch.setattr(fused_moe_layer, "get_tp_rank", lambda: rank)
        monkeypatch.setattr(fused_moe_layer, "get_tp_size", lambda: 2)
        layer = FusedMoE(8, 2, 64, 32, renormalize=True)
        assert layer.w13_weight.shape == (8, 32, 64) and layer.w2_weight.shape == (8, 64, 16)
        with torch.no_grad():
            for e in range(8):
                for name, (param, shard) in fused_moe_layer.EXPERT_PARAMS_MAPPING.items():
                    p = getattr(layer, param)
                    p.weight_loader(p, tensors[f"{prefix}.{e}.{name}.weight"], (e, shard))
        layers.append(layer)
    for e in range(8):
        gate = torch.cat([layer.w13_weight[e, :16] for layer in layers])
        up = torch.cat([layer.w13_weight[e, 16:] for layer in layers])
        down = torch.cat([layer.w2_weight[e] for layer in layers], dim=1)
        assert torch.equal(gate, tensors[f"{prefix}.{e}.gate_proj.weight"])
        assert torch.equal(up, tensors[f"{prefix}.{e}.up_proj.weight"])
        assert torch.equal(down, tensors[f"{prefix}.{e}.down_proj.weight"])
    with pytest.raises(ValueError, match="shard id"):
        layers[0].weight_loader(layers[0].w2_weight, tensors[f"{prefix}.0.down_proj.weight"],
                                (8, "w2"))  # fmt: skip


def test_greedy_tokens_equal_transformers_with_a_prefix_hit() -> None:
    path = tiny_checkpoint("qwen3_moe")
    hf_model = load_hf_reference(path)
    shared = random_prompts([13], seed=4)[0]
    prompts = [shared + [5, 6], random_prompts([9], seed=5)[0]]
    llm = LLM(str(path), **ENGINE)
    try:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        for prompt, out in zip(prompts, outputs):
            assert out["token_ids"] == hf_greedy(hf_model, prompt, GREEDY.max_tokens)
        second = shared + [7, 8, 9]
        hit = llm.generate([second], GREEDY, use_tqdm=False)[0]
        assert hit["num_cached_tokens"] == 12  # three full blocks of the shared prefix
        assert hit["token_ids"] == hf_greedy(hf_model, second, GREEDY.max_tokens)
    finally:
        llm.exit()


@pytest.mark.slow  # two worker processes over gloo
def test_tensor_parallel_2_gives_transformers_tokens() -> None:
    path = tiny_checkpoint("qwen3_moe")
    prompts = random_prompts([7, 13, 4], seed=6)
    llm = LLM(str(path), tensor_parallel_size=2, **ENGINE)
    try:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    finally:
        llm.exit()
    assert multiprocessing.active_children() == []
    hf_model = load_hf_reference(path)
    for prompt, out in zip(prompts, outputs):
        assert out["token_ids"] == hf_greedy(hf_model, prompt, GREEDY.max_tokens)


def test_tensor_parallel_size_must_divide_the_expert_intermediate_size(monkeypatch) -> None:
    monkeypatch.setattr(fused_moe_layer, "get_tp_size", lambda: 3)
    with pytest.raises(ValueError, match="moe_intermediate_size=32 is not divisible"):
        FusedMoE(8, 2, 64, 32, renormalize=True)
