"""Step 2: model definitions, and the registry from config.json "architectures" to a class.

The registry names modules instead of importing them, so each model file is imported only
when a checkpoint asks for it. That keeps `import myvllm` working while a student has
deleted models/llama.py for the exercise (HowToApproachvLLM.md) and is writing it back.
"""

from __future__ import annotations

import importlib

from torch import nn

# config.json "architectures" entry -> (module under myvllm.models, class name)
MODEL_REGISTRY: dict[str, tuple[str, str]] = {
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),
}


def get_model_class(architectures: list[str] | tuple[str, ...] | None) -> type[nn.Module]:
    """The first supported class among config.architectures (ValueError if none is)."""
    for name in architectures or ():
        if name in MODEL_REGISTRY:
            module_name, class_name = MODEL_REGISTRY[name]
            full_name = f"myvllm.models.{module_name}"
            try:
                module = importlib.import_module(full_name)
            except ModuleNotFoundError as e:
                if e.name != full_name:
                    raise  # the file is there; an import inside it failed
                raise ModuleNotFoundError(
                    f"{name} is registered to {full_name}, but its file "
                    f"models/{module_name}.py is missing", name=full_name
                ) from e
            return getattr(module, class_name)
    raise ValueError(
        f"unsupported model architecture {list(architectures or [])!r}; "
        f"supported: {sorted(MODEL_REGISTRY)}"
    )
