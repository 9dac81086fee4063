"""The Scheduler as the checks of engine/request_checks.py see it: a type only (they import it
for type checking), so the checks need not import the scheduler that calls them."""

from __future__ import annotations

from collections import deque
from typing import Protocol

from myvllm.engine.block_manager import BlockManager
from myvllm.engine.sequence import Sequence


class SchedulerView(Protocol):
    """What the checks of engine/request_checks.py read of the Scheduler (engine/scheduler.py,
    which imports them)."""

    block_size: int
    max_model_length: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool
    block_manager: BlockManager
    waiting: deque[Sequence]
    running: deque[Sequence]
