"""Which device a benchmark script runs on, and the one-line refusal when it cannot run.

A full benchmark on a CPU would run for many minutes and measure nothing worth keeping, so
without a GPU every script stops at once and names its CPU modes instead.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch


def require_gpu(script: str, cpu_modes: str = "--quick") -> torch.device:
    """The CUDA device; without one, exit with a hint that names the script's CPU modes."""
    if not torch.cuda.is_available():
        raise SystemExit(f"{Path(script).name} needs a CUDA GPU; use {cpu_modes} on the CPU")
    return torch.device("cuda")


def kernel_device(script: str, quick: bool) -> torch.device:
    """A kernel benchmark's device: the GPU, or with --quick and no GPU the CPU, where the
    Triton kernels run in Triton's interpreter."""
    if quick and not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"  # read when triton is imported (in main)
        return torch.device("cpu")
    return require_gpu(script)
