"""RoPE's cos/sin table and its inverse frequencies, plain or scaled for a longer context.

Supported scaling: None/"default" (plain RoPE) and "llama3" (Llama-3.1/3.2: long wavelengths
are stretched by ``factor``, short ones kept, the band in between smoothly interpolated).
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch

SUPPORTED_ROPE_TYPES = ("default", "llama3")


def _default_inv_freq(head_dim: int, base: float) -> torch.Tensor:
    # Same expression as HF, so the float32 values agree bit for bit.
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    return 1.0 / (base**exponent)


def _llama3_inv_freq(head_dim: int, base: float, scaling: dict) -> torch.Tensor:
    inv_freq = _default_inv_freq(head_dim, base)
    try:
        factor = float(scaling["factor"])
        low_freq_factor = float(scaling["low_freq_factor"])
        high_freq_factor = float(scaling["high_freq_factor"])
        old_context_len = float(scaling["original_max_position_embeddings"])
    except KeyError as e:
        raise ValueError(
            f"llama3 rope scaling is missing the field {e.args[0]!r}: {scaling}"
        ) from e
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths (low frequencies) are divided by `factor`; short ones are untouched.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    # In between, blend the two, moving linearly with old_context_len / wavelen.
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _rope_type(rope_scaling: dict | None) -> str:
    if not rope_scaling:
        return "default"
    return str(rope_scaling.get("rope_type", rope_scaling.get("type", "default")))


def inverse_frequencies(head_dim: int, base: float, scaling: dict | None) -> torch.Tensor:
    """[head_dim / 2] float32: the angle per position of each rotated pair."""
    rope_type = _rope_type(scaling)
    if rope_type == "default":
        return _default_inv_freq(head_dim, base)
    if rope_type == "llama3":
        return _llama3_inv_freq(head_dim, base, scaling or {})
    raise ValueError(
        f"unsupported rope scaling type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}"
    )


@lru_cache(maxsize=8)
def _cos_sin_table(
    head_dim: int, max_position: int, base: float, scaling_items: tuple, device: str
) -> torch.Tensor:
    """[max_position, head_dim] float32: cos of every (position, frequency) in the first half,
    sin in the second. Cached, so every layer's RotaryEmbedding holds the same tensor."""
    if head_dim % 2 != 0:
        raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
    inv_freq = inverse_frequencies(head_dim, base, dict(scaling_items) if scaling_items else None)
    positions = torch.arange(max_position, dtype=torch.float32, device=device)
    freqs = torch.outer(positions, inv_freq.to(device))  # [max_position, D/2]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def _freeze(value: object) -> object:
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, list):
        return tuple(_freeze(v) for v in value)
    return value


def cos_sin_table(head_dim: int, max_position: int, base: float,
                  rope_scaling: dict | None) -> torch.Tensor:
    """The cos/sin table of these settings on the default device, one tensor per settings."""
    scaling_items = (
        tuple(sorted((k, _freeze(v)) for k, v in rope_scaling.items())) if rope_scaling else ()
    )
    return _cos_sin_table(head_dim, max_position, base, scaling_items,
                          str(torch.get_default_device()))
