"""Step 2: model definitions, and the registry from config.json "architectures" to a class."""

from __future__ import annotations

from torch import nn

from myvllm.models.llama import LlamaForCausalLM
from myvllm.models.qwen3 import Qwen3ForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
}


def get_model_class(architectures: list[str] | tuple[str, ...] | None) -> type[nn.Module]:
    """The first supported class among config.architectures (ValueError if none is)."""
    for name in architectures or ():
        if name in MODEL_REGISTRY:
            return MODEL_REGISTRY[name]
    raise ValueError(
        f"unsupported model architecture {list(architectures or [])!r}; "
        f"supported: {sorted(MODEL_REGISTRY)}"
    )
