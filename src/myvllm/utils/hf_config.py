"""A checkpoint's transformers config, tokenizer and end-of-sequence ids.

    load_hf_config(path)                   -> transformers PretrainedConfig
    load_tokenizer(path)                   -> transformers tokenizer
    eos_token_ids(path, config, tokenizer) -> (eos id, ...)
    with gguf_parsed_once(): ...           -> one parse of a GGUF file for all three readers

``path`` is a checkpoint directory (config.json) or a .gguf file (its metadata), as
utils/model_path.py resolves it. ``trust_remote_code`` is refused: it runs code from the
checkpoint.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

from myvllm.utils.checkpoint import SUPPORTED_GGUF_ARCHITECTURES, CheckpointError


def _split_gguf(path: str | os.PathLike[str]) -> tuple[str, str] | None:
    p = Path(path)
    return (str(p.parent), p.name) if p.suffix == ".gguf" else None


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


@contextlib.contextmanager
def gguf_parsed_once() -> Iterator[None]:
    """Inside this block every ``gguf.GGUFReader`` of one file is the same parsed reader.

    Building an engine from a GGUF file reads it three times: transformers parses it for the
    config and again for the tokenizer, and we parse it for the weights (utils/checkpoint.py).
    Each parse builds the metadata (49,152 vocabulary entries for SmolLM2) in Python: about
    6 s on a 2-core CPU. transformers imports ``GGUFReader`` from the ``gguf`` module when it
    reads a file, and so do we, so replacing the module's attribute for the duration of the
    block lets all three share one.
    """
    if importlib.util.find_spec("gguf") is None:
        yield
        return
    import gguf

    original = gguf.GGUFReader
    readers: dict[tuple[str, str], Any] = {}

    def shared_reader(path: str | os.PathLike[str],
                      mode: Literal["r", "r+", "c"] = "r") -> Any:
        key = (os.path.realpath(os.fspath(path)), mode)
        if key not in readers:
            readers[key] = original(path, mode)
        return readers[key]

    # setattr: the type checker rightly refuses to assign to a class name; replacing the
    # module's attribute for the block is the point here.
    setattr(gguf, "GGUFReader", shared_reader)  # noqa: B010
    try:
        yield
    finally:
        setattr(gguf, "GGUFReader", original)  # noqa: B010
