"""Which implementation a kernel call runs: Triton on CUDA tensors (when Triton is installed),
else the PyTorch reference; MYVLLM_FORCE_TRITON overrides the choice at call time (the
kernels package's docstring says how). Apart from the kernels so that every dispatching
module (kernels/__init__.py, kernels/linear_kernels.py, kernels/fused_ops.py) can ask.
"""

from __future__ import annotations

import importlib.util
import os
from functools import lru_cache

import torch


@lru_cache(maxsize=1)
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def use_triton(tensor: torch.Tensor) -> bool:
    """Whether a kernel called with `tensor` goes to Triton (see the kernels package's
    docstring)."""
    forced = os.environ.get("MYVLLM_FORCE_TRITON", "")
    if forced == "1":
        if not triton_available():
            raise RuntimeError("MYVLLM_FORCE_TRITON=1 but the triton package is not installed")
        return True
    if forced == "0":
        return False
    return tensor.is_cuda and triton_available()

