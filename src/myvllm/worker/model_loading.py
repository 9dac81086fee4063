"""build_model: the checkpoint's model class, built on the device in the model's dtype, with
its weights (or random ones, load_format="dummy": config.json is enough); on a GPU, with the
small ops fused into the kernels of the layers after them (layers/fused.py)."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from myvllm.config import Config
from myvllm.layers.fused import fuse_layer_ops
from myvllm.models import get_model_class
from myvllm.utils.dummy_weights import initialize_dummy_weights
from myvllm.utils.loader import load_model


class CausalLM(Protocol):
    """What the runner needs of a model class (models/decoder.py's CausalLM, which every model
    file builds on)."""

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor: ...

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None: ...


def build_model(config: Config, hf_config: Any, model_path: str, device: torch.device,
                dtype: torch.dtype) -> torch.nn.Module:
    """The model in eval mode; its parameters are made in dtype, on the device."""
    model_class = get_model_class(getattr(hf_config, "architectures", None) or [])
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            module = model_class(hf_config)
    finally:
        torch.set_default_dtype(default_dtype)
    if device.type == "cuda":
        fuse_layer_ops(module)
    if config.load_format == "dummy":
        initialize_dummy_weights(module)
    else:
        load_model(module, model_path)
    return module.eval()
