"""Random weights for a model built from its config alone (``Config.load_format="dummy"``).

    initialize_dummy_weights(model)        every parameter filled in place, no file read

For speed measurements on shapes whose checkpoint is not at hand (Qwen3-8B, a MoE): the time
of a step does not depend on the weights' values, only on their shapes and dtype. The values
still have to keep the forward pass finite, so that the sampler sees real numbers:

    RMSNorm weights          1 (the identity scale, where training starts them); found by
                             name: every checkpoint names a norm's module ...norm
                             (input_layernorm, post_attention_layernorm, q_norm, k_norm, norm)
    everything else          uniform in [-1e-3, 1e-3] (vLLM's dummy range)

With every matrix entry at most 1e-3, a row of hidden size H moves a unit-scale input by at
most H * 1e-3 (4.1 for Qwen3-8B), and every decoder layer's input goes through an RMSNorm
first, so the activations stay O(1) however deep the model is.

The values come from one generator seeded with DUMMY_WEIGHT_SEED, drawn in the order of
``named_parameters()``, so a model of one config on one device gets the same weights every
time. Each tensor-parallel rank fills its own shard this way, so the weights differ between
tensor_parallel_size 1 and 2 (they are not one model cut in two): compare speeds across sizes,
not tokens.
"""

from __future__ import annotations

import torch
from torch import nn

DUMMY_WEIGHT_SEED = 0
DUMMY_WEIGHT_RANGE = (-1e-3, 1e-3)


def is_norm_weight(name: str) -> bool:
    """Whether parameter ``name`` is a norm's scale (model.layers.0.input_layernorm.weight)."""
    module, _, param = name.rpartition(".")
    return param == "weight" and module.rpartition(".")[2].endswith("norm")


@torch.no_grad()
def initialize_dummy_weights(model: nn.Module, seed: int = DUMMY_WEIGHT_SEED) -> None:
    """Fill every parameter of ``model`` in place: RMSNorm weights 1, the rest uniform."""
    low, high = DUMMY_WEIGHT_RANGE
    generators: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():  # a tied weight is listed (and filled) once
        if is_norm_weight(name):
            param.fill_(1.0)
            continue
        if not param.is_floating_point():
            raise TypeError(f"cannot fill a {param.dtype} parameter with random weights")
        if param.device not in generators:
            generators[param.device] = torch.Generator(param.device).manual_seed(seed)
        param.uniform_(low, high, generator=generators[param.device])
