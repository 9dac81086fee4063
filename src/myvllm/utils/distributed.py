"""Tensor-parallel rank and world size, read from torch.distributed.

Layers call these at construction time to decide which shard of each weight they own.
Without an initialised process group we are a single rank (rank 0 of 1), so the model
classes work unchanged in plain single-process use and in tests.
"""

from __future__ import annotations

import torch.distributed as dist


def get_tp_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def get_tp_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
