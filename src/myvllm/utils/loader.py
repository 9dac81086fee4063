"""Load a checkpoint's weights into our model, strictly.

    load_model(model, path)                -> fills model's parameters from a dir or .gguf

load_model never copies a tensor itself. It maps each checkpoint name to our parameter name
(packed names through ``model.packed_modules_mapping``) and hands the FULL tensor to that
parameter's ``weight_loader``, which cuts out this rank's shard (see layers/linear.py):

    model.layers.0.self_attn.k_proj.weight
        -> param "model.layers.0.self_attn.qkv_proj.weight", shard "k"
        -> param.weight_loader(param, tensor, "k")

The experts of a mixture-of-experts layer are stacked into one parameter per projection; an
expert's tensor names its expert, and the shard id carries it (``model.expert_params_mapping``,
layers/fused_moe.py):

    model.layers.1.mlp.experts.5.up_proj.weight
        -> param "model.layers.1.mlp.experts.w13_weight", shard (5, "w3")

It is strict: before reading any tensor data it checks that every checkpoint tensor has a
parameter and every parameter (every shard of a packed one) has a tensor; a mis-shaped tensor
stops loading with its name. A tied lm_head (same Parameter as embed_tokens) needs no tensor;
when the checkpoint has one anyway it is not loaded, and a warning says so if it differs from
the embedding. Reading the files is utils/checkpoint.py's job.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any

import torch
from torch import nn

from myvllm.utils.checkpoint import Checkpoint, CheckpointError
from myvllm.value_checks import refusal

logger = logging.getLogger("myvllm")

# Checkpoint tensors that are not parameters: old Llama exports saved RoPE's inverse
# frequencies, which we derive from the config.
IGNORED_TENSOR_SUFFIXES = ("rotary_emb.inv_freq",)


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor,
                          shard_id: object = None) -> None:
    """The loader of a parameter that carries none (an RMSNorm's weight): a checked copy."""
    if shard_id is not None:
        raise refusal("shard_id", shard_id, "None (this parameter is not packed)")
    if tuple(param.shape) != tuple(loaded_weight.shape):
        raise refusal("shape", tuple(loaded_weight.shape),
                      f"{tuple(param.shape)}, the parameter's shape")
    param.data.copy_(loaded_weight)


# An expert's tensor: <prefix>.experts.<expert>.<expert_params_mapping key>.weight
EXPERT_NAME = re.compile(r"^(.*\.experts)\.(\d+)\.([^.]+)\.weight$")


def _packed_target(name: str, packed: dict[str, tuple[str, Any]],
                   experts: dict[str, tuple[str, str]]) -> tuple[str, Any]:  # fmt: skip
    """Checkpoint name -> (our parameter name, shard id or None); matches whole name parts."""
    match = EXPERT_NAME.match(name) if experts else None
    if match and match.group(3) in experts:
        target, shard = experts[match.group(3)]
        return f"{match.group(1)}.{target}", (int(match.group(2)), shard)
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in packed:
            target, shard_id = packed[part]
            return ".".join(parts[:i] + [target] + parts[i + 1 :]), shard_id
    return name, None


def _expected_keys(params: dict[str, nn.Parameter], packed: dict[str, tuple[str, Any]],
                   experts: dict[str, tuple[str, str]]) -> set[tuple[str, Any]]:  # fmt: skip
    """(parameter, shard) pairs that a complete checkpoint must provide."""
    shards_of: dict[str, list[Any]] = {}
    for target, shard_id in packed.values():
        shards_of.setdefault(target, []).append(shard_id)
    expert_shards: dict[str, list[str]] = {}
    for target, shard in experts.values():
        expert_shards.setdefault(target, []).append(shard)
    expected: set[tuple[str, Any]] = set()
    for name, param in params.items():
        last = name.rsplit(".", 1)[-1]
        if name.endswith(f"experts.{last}") and last in expert_shards:
            # A stacked experts parameter: every shard of every expert (dim 0).
            expected.update((name, (e, s)) for e in range(param.shape[0])
                            for s in expert_shards[last])  # fmt: skip
            continue
        packed_part = next((p for p in name.split(".") if p in shards_of), None)
        if packed_part is None:
            expected.add((name, None))
        else:
            expected.update((name, s) for s in shards_of[packed_part])
    return expected


def _rename_part(name: str, source_of: dict[tuple[str, Any], str], shard_id: Any) -> str:
    if isinstance(shard_id, tuple):  # an expert's shard: (expert, "w1" | "w2" | "w3")
        prefix, target = name.rsplit(".", 1)
        source = source_of.get((target, shard_id[1]))
        if source is not None:
            return f"{prefix}.{shard_id[0]}.{source}.weight"
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
    checkpoint = Checkpoint(path)
    packed: dict[str, tuple[str, Any]] = getattr(model, "packed_modules_mapping", {})
    experts: dict[str, tuple[str, str]] = getattr(model, "expert_params_mapping", {})
    params = dict(model.named_parameters())  # tied weights appear once, under the first name
    aliases = set(dict(model.named_parameters(remove_duplicate=False))) - set(params)

    # 1. Names only, before any tensor data is read: unexpected and missing tensors.
    unexpected = [f"{n} (GGUF name, no HF equivalent)" for n in checkpoint.unmapped]
    provided: set[tuple[str, Any]] = set()
    for name in checkpoint.names:
        if name.endswith(IGNORED_TENSOR_SUFFIXES):
            continue
        target, shard_id = _packed_target(name, packed, experts)
        if target in aliases:
            continue  # e.g. lm_head.weight of a tied model: it IS embed_tokens.weight
        if target not in params or (isinstance(shard_id, tuple)  # an expert past the last
                                    and shard_id[0] >= params[target].shape[0]):
            unexpected.append(name)
        else:
            provided.add((target, shard_id))
    # Report missing shards by the checkpoint name they would have come from (k_proj, ...).
    source_of = {(target, shard): part for part, (target, shard) in packed.items()}
    source_of.update({(target, shard): part for part, (target, shard) in experts.items()})
    missing = sorted(
        p if s is None else _rename_part(p, source_of, s)
        for p, s in _expected_keys(params, packed, experts) - provided
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
            target, shard_id = _packed_target(name, packed, experts)
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
