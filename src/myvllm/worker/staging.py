"""Staging: one step's host arrays become the device tensors its forward pass reads, as
FreshTensors (all a CPU uses) or, on a GPU, for a step that fits a CUDA graph, in the fixed
places of StaticBuffers (worker/static_buffers.py) that the graph reads; and the step's
sampled tokens come back as SampledTokens (on a GPU, and with async scheduling, through the
sampled-token pool: worker/token_pool.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

if TYPE_CHECKING:
    from myvllm.sample.logprobs import StepLogprobs

NUMPY_DTYPES = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32}


class FreshTensors:
    """New tensors every step (a CPU; a GPU step that no graph replays)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pin_memory = device.type == "cuda"

    def tensor(self, values: np.ndarray | list[int] | list[float], dtype: torch.dtype
               ) -> torch.Tensor:
        """One host array on the device, without making the host wait. Through numpy:
        torch.tensor() of a long Python list is ~3x slower (~7 ms for a 32k-token chunk)."""
        host = torch.from_numpy(np.asarray(values, dtype=NUMPY_DTYPES[dtype]))
        if not self.pin_memory:
            return host.to(self.device)
        return host.pin_memory().to(self.device, non_blocking=True)


def block_table_array(tables: list[list[int]], width: int) -> np.ndarray:
    """Block tables as an int32 rectangle [one row per table, width], -1 past each table's
    end (never read by the kernels). (A padded step writes its own into StaticBuffers:
    worker/static_buffers.py.)"""
    array = np.full((len(tables), width), -1, dtype=np.int32)
    for row, table in enumerate(tables):
        array[row, : len(table)] = table
    return array


class VerifiedRows(Protocol):
    """Speculative decoding's tokens of a step's verification rows (spec_decode/
    verification.py's VerifiedTokens)."""

    def token_lists(self) -> dict[int, list[int]]: ...


class SampledTokens:
    """The token ids of one step, on their way to the host: token_ids() waits for the copy.

    host: the tokens in host memory (a CPU: the sampler's own output). wait: what waits until
    the device's copy into it has landed (a GPU's pinned slot, TokenPool.read_back), None
    when the step has run already (a CPU)."""

    def __init__(self, host: torch.Tensor, logprobs: StepLogprobs | None = None,
                 wait: Callable[[], None] | None = None) -> None:
        self.host = host
        self.wait = wait
        self.logprobs = logprobs  # valid once token_ids() has waited
        # Speculative decoding: the rows' verified tokens (their token_ids() entry is unused).
        self.verified: VerifiedRows | None = None

    def token_ids(self) -> list[int]:
        if self.wait is not None:
            self.wait()
        return self.host.tolist()
