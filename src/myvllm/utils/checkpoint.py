"""Read a checkpoint's tensors, as (HF name, full tensor), from safetensors or GGUF.

    Checkpoint(path).names                 HF tensor names, before any data is read
    Checkpoint(path).tensors()             (HF name, full float tensor), one at a time
    iter_checkpoint_tensors(path)          the same, refusing GGUF tensors with no HF name

Only safetensors and GGUF are read: both are plain data. A directory holding only pickle
``.bin`` weights is refused, because unpickling can run code from the file.

GGUF files use llama.cpp's tensor names (blk.N.attn_q.weight) and, for llama, its q/k row
order; both are turned back into the HF checkpoint's, so the loader sees one format.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

SUPPORTED_GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


class CheckpointError(ValueError):
    """The checkpoint does not fit the model or cannot be read (message names file/tensor)."""


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


class Checkpoint:
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
        """The file that holds tensor ``name``, for error messages."""
        return self.path.name if self.is_gguf else self.st_index[name].name

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor) for every mapped tensor, read one at a time."""
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
            # Only llama.cpp's *llama* converter permutes q/k (qwen2 and qwen3 keep the HF
            # layout, biases included).
            m = _GGUF_LAYER_RE.match(t.name)
            if self.arch == "llama" and m is not None and m.group(2) in ("attn_q", "attn_k"):
                heads = n_head if m.group(2) == "attn_q" else n_kv_head
                tensor = _unpermute_llama_qk(tensor, int(heads))
            yield hf_name, tensor


def iter_checkpoint_tensors(path: str | os.PathLike[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF tensor name, full float tensor) for every tensor of a safetensors dir or GGUF file."""
    checkpoint = Checkpoint(path)
    if checkpoint.unmapped:
        raise CheckpointError(f"GGUF tensors with no HF name: {checkpoint.unmapped[:10]}")
    yield from checkpoint.tensors()
