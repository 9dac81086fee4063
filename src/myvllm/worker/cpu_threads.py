"""How many torch threads an engine on the CPU runs with.

torch splits each op over all the cores by default. For a small model that is a loss: an op
on a [4, 64] activation takes microseconds, less than the threads need to meet at its end,
and on a busy machine (other jobs, or the engine's own processes beside each other: the
server's core process, tensor-parallel ranks) a thread that waits for a descheduled partner
stalls the whole step. benchmarks/benchmark_cpu_threads.py measures it; docs/benchmarks.md has the
figures behind the rule below.
"""

from __future__ import annotations

import os
import weakref
from typing import Any

import torch

from myvllm.config import Config

# Below this hidden size one thread is the default. Measured on a busy 2-core machine: a tiny
# Llama (hidden 64, the tests' size) generated 4 x 64 tokens in 0.42 s on one thread and 3.76 s
# on two; the soak tests (hidden 32) ran 6.5x faster on one. The bundled SmolLM2 (hidden 576)
# keeps torch's default, every core, which has not been measured against one thread on a
# quiet machine yet: 512 only separates the two kinds of model measured.
SMALL_MODEL_HIDDEN = 512


def usable_cores() -> int:
    """The cores this process may run on (fewer than the machine's under taskset or a
    container's CPU set)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def cpu_thread_count(config: Config, hf_config: Any) -> int:
    """Threads for each of the engine's processes: Config.cpu_threads, or the rule above,
    shared out among the tensor-parallel ranks (which run on the same cores)."""
    cores = usable_cores()
    if config.cpu_threads:
        wanted = config.cpu_threads
    elif hf_config.hidden_size < SMALL_MODEL_HIDDEN:
        wanted = 1
    else:
        wanted = cores
    return max(1, wanted // config.tensor_parallel_size)


def claim_cpu_threads(owner: object, config: Config, hf_config: Any
                      ) -> tuple[int, weakref.finalize]:
    """Run this process's torch ops on its share of the cores (cpu_thread_count) until the
    engine ends: returns the share (each tensor-parallel worker takes the same) and what
    gives the caller its own thread count back, called at shutdown, or when owner is
    collected or the interpreter exits, whichever comes first (at most once)."""
    threads = cpu_thread_count(config, hf_config)
    give_back = weakref.finalize(owner, torch.set_num_threads, torch.get_num_threads())
    torch.set_num_threads(threads)
    return threads, give_back
