"""Config.load_format="dummy": a model from config.json alone, and the configs/ folder.

The dummy engine runs on a folder holding nothing but config.json: if anything tried to read
a checkpoint there, it would fail ("no *.safetensors weight files").
"""

from __future__ import annotations

import json
from fnmatch import fnmatch
from pathlib import Path

import pytest
import torch
from helpers_models import prefill_context, random_prompts, tiny_config

from myvllm import LLM, Config, SamplingParams
from myvllm.config import LOAD_FORMATS
from myvllm.layers.layernorm import RMSNorm
from myvllm.models import MODEL_REGISTRY, get_model_class
from myvllm.models.config import get_head_dim
from myvllm.utils.context import forward_context
from myvllm.utils.dummy_weights import DUMMY_WEIGHT_RANGE, initialize_dummy_weights
from myvllm.utils.hf_config import load_hf_config

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted(p.parent.name for p in (REPO / "configs").glob("*/config.json"))
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
ENGINE_KW = dict(block_size=4, num_kvcache_blocks=32, max_model_length=64,
                 max_num_batched_tokens=128)


@pytest.fixture
def config_only(tmp_path: Path) -> Path:
    config = tiny_config("qwen3")
    config.architectures = ["Qwen3ForCausalLM"]
    config.save_pretrained(str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]
    return tmp_path


def test_bad_load_format_is_a_clear_error() -> None:
    assert LOAD_FORMATS == ("auto", "dummy")
    with pytest.raises(ValueError, match=r"Config.load_format='pt': allowed: 'auto', "
                                         r"'dummy'"):
        Config(load_format="pt")


def test_dummy_engine_runs_from_config_json_alone(config_only: Path) -> None:
    llm = LLM(str(config_only), load_format="dummy", **ENGINE_KW)
    try:
        assert llm.tokenizer is None
        outs = llm.generate(random_prompts([7, 3]), GREEDY, use_tqdm=False)
        assert [len(o["token_ids"]) for o in outs] == [6, 6]
        assert all(0 <= t < 256 for o in outs for t in o["token_ids"])
        assert all(o["text"] is None for o in outs)
        with pytest.raises(ValueError, match="has no tokenizer: pass prompts as lists of token"):
            llm.generate(["a text prompt"], GREEDY, use_tqdm=False)
    finally:
        llm.exit()
    # The weights-reading path refuses the same folder, naming what is missing.
    with pytest.raises(ValueError, match=r"no \*\.safetensors weight files"):
        LLM(str(config_only), **ENGINE_KW)


@pytest.mark.slow
def test_dummy_engine_under_tensor_parallelism(config_only: Path) -> None:
    """Every worker builds its shard from the config too (each fills its own random shard)."""
    llm = LLM(str(config_only), load_format="dummy", tensor_parallel_size=2, **ENGINE_KW)
    try:
        outs = llm.generate(random_prompts([5]), GREEDY, use_tqdm=False)
        assert len(outs[0]["token_ids"]) == 6
    finally:
        llm.exit()


@torch.no_grad()
def test_dummy_weights_are_small_finite_and_repeatable(config_only: Path) -> None:
    config = load_hf_config(config_only)
    models = []
    for _ in range(2):
        model = get_model_class(config.architectures)(config)
        initialize_dummy_weights(model)
        models.append(model)
    first, second = (dict(m.named_parameters()) for m in models)
    assert all(torch.equal(first[n], second[n]) for n in first)  # one seed, the same weights
    norm_weights = {id(m.weight) for m in models[0].modules() if isinstance(m, RMSNorm)}
    assert norm_weights  # layer norms and Qwen3's q/k norms
    low, high = DUMMY_WEIGHT_RANGE
    for name, p in first.items():
        if id(p) in norm_weights:
            assert torch.all(p == 1), name
        else:
            assert low <= p.min() and p.max() <= high and p.std() > 0, name

    # Logits are finite, and the weights are not so small that the output ignores the input.
    prompts = random_prompts([6, 6], seed=1)
    with forward_context(prefill_context([6, 6])):
        hidden = models[0](torch.tensor(sum(prompts, [])), torch.arange(6).repeat(2))
    logits = models[0].compute_logits(hidden)
    assert torch.isfinite(logits).all()
    assert not torch.equal(logits[:6], logits[6:])


# The parameter counts the model cards give (total; without the embedding and LM head).
PARAMETERS = {
    "Qwen3-0.6B": (0.60e9, 0.44e9),
    "Qwen3-8B": (8.2e9, 6.95e9),
    "Qwen3-30B-A3B": (30.5e9, 29.9e9),
}
# K and V bytes per token in bf16 (every layer, every KV head).
KV_BYTES_PER_TOKEN = {"Qwen3-0.6B": 112 * 1024, "Qwen3-8B": 144 * 1024,
                      "Qwen3-30B-A3B": 96 * 1024}


def test_configs_folder_holds_the_benchmarked_shapes() -> None:
    assert set(CONFIGS) == set(PARAMETERS)


@pytest.mark.parametrize("name", CONFIGS)
def test_config_builds_its_model_at_the_published_size(name: str) -> None:
    """Built on the meta device: shapes only, no memory (Qwen3-8B is 16 GB in bf16)."""
    folder = REPO / "configs" / name
    raw = json.loads((folder / "config.json").read_text())
    config = load_hf_config(folder)
    assert config.architectures == raw["architectures"]
    assert config.torch_dtype in ("bfloat16", torch.bfloat16)
    kv_bytes = 2 * config.num_hidden_layers * config.num_key_value_heads * get_head_dim(config) * 2
    assert kv_bytes == KV_BYTES_PER_TOKEN[name]
    if config.architectures[0] not in MODEL_REGISTRY:
        pytest.skip(f"{config.architectures[0]} is not a registered model")
    with torch.device("meta"):
        model = get_model_class(config.architectures)(config)
    total = sum(p.numel() for p in model.parameters())  # a tied weight counts once
    embeddings = model.model.embed_tokens.weight.numel() * (1 if config.tie_word_embeddings else 2)
    want_total, want_body = PARAMETERS[name]
    assert total == pytest.approx(want_total, rel=0.01)
    assert total - embeddings == pytest.approx(want_body, rel=0.01)


def test_load_format_is_a_serve_flag() -> None:
    from myvllm.entrypoints import cli

    args = cli.build_parser().parse_args(["serve", "configs/Qwen3-8B", "--load-format", "dummy"])
    assert cli.engine_config(args) == Config(model="configs/Qwen3-8B", load_format="dummy")


def test_dummy_hub_download_fetches_no_weights(monkeypatch: pytest.MonkeyPatch,
                                               tmp_path: Path) -> None:
    import huggingface_hub

    from myvllm.utils.model_path import resolve_model_path

    calls: list[dict] = []

    def fake(repo_id: str, **kwargs: object) -> str:
        calls.append(kwargs)
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    resolve_model_path("Qwen/Qwen3-8B", weights=False)
    resolve_model_path("Qwen/Qwen3-8B")
    without, with_weights = (c["allow_patterns"] for c in calls)
    assert any(fnmatch("config.json", p) for p in without)
    assert not any(fnmatch("model-00001-of-00005.safetensors", p) for p in without)
    assert any(fnmatch("model-00001-of-00005.safetensors", p) for p in with_weights)


def test_benchmark_runs_configs_folders_with_dummy_weights(tmp_path: Path) -> None:
    """benchmark_tps.py --model configs/NAME: dummy weights; a checkpoint: its own weights."""
    import argparse

    from benchmarks.workload import pick_model

    def pick(model: str | None, load_format: str | None = None) -> tuple[Path, str]:
        args = argparse.Namespace(model=model, load_format=load_format, quick=False)
        return pick_model(args, tmp_path, "cpu")

    assert pick("configs/Qwen3-8B") == (Path("configs/Qwen3-8B"), "dummy")
    assert pick(None, "dummy") == (REPO / "configs" / "Qwen3-0.6B", "dummy")
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text("{}")
    (checkpoint / "model.safetensors").write_bytes(b"")
    assert pick(str(checkpoint)) == (checkpoint, "auto")
    assert pick(str(checkpoint), "dummy") == (checkpoint, "dummy")
    assert pick("Qwen/Qwen3-8B") == (Path("Qwen/Qwen3-8B"), "auto")  # a hub id
