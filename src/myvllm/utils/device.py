"""Which device and dtype the engine runs in, from Config.device and Config.dtype."""

from __future__ import annotations

import torch

from myvllm.config import Config
from myvllm.utils.distributed import local_device_index


def resolve_device(config: Config) -> torch.device:
    """"auto" is the GPU when torch sees one, else the CPU; "cuda" without one is an error."""
    if config.device == "cpu":
        return torch.device("cpu")
    if config.device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("Config.device='cuda' but torch sees no CUDA device.")
        return torch.device("cuda")
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def rank_device(config: Config, rank: int) -> torch.device:
    """A tensor-parallel rank's device; on a GPU its GPU on this host (LOCAL_RANK under
    torchrun), made the current one."""
    device = resolve_device(config)
    if device.type != "cuda":
        return device
    device = torch.device("cuda", local_device_index(rank))
    torch.cuda.set_device(device)
    return device


def resolve_dtype(config: Config, device: torch.device) -> torch.dtype:
    if config.dtype == "auto":
        # bf16 is what the checkpoints are trained in; on a CPU fp32 is both faster and exact.
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    dtype = getattr(torch, config.dtype)
    assert isinstance(dtype, torch.dtype)  # Config checked the name
    return dtype


def resolve_kv_cache_dtype(config: Config, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's element type: the model's dtype ("auto") or float8 e4m3 ("fp8").

    e4m3fn (4 exponent bits, 3 mantissa bits, no infinities, largest value 448) is the fp8
    format vLLM's "fp8" means; e5m2 trades a mantissa bit for range that K and V do not need.
    """
    if config.kv_cache_dtype == "fp8":
        return torch.float8_e4m3fn
    return model_dtype
