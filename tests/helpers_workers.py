"""Helpers for the tests where a tensor-parallel worker dies (tests/engine/test_worker_death.py
on CPU over gloo, tests/gpu/test_gpu_worker_death.py over NCCL)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch.distributed as dist

from myvllm.executor.errors import EngineDeadError

# A call still blocked this long after a worker died counts as hung (the watchdog notices a
# death within about a second).
HANG_LIMIT_S = 30.0


def returns_within(fn: Callable[[], Any], limit_s: float = HANG_LIMIT_S) -> BaseException | None:
    """Run fn in a thread; the exception it raised (None if none). Fails the test if fn is
    still running after limit_s: the thread is left blocked, the test does not hang."""
    raised: list[BaseException] = []

    def target() -> None:
        try:
            fn()
        except BaseException as e:
            raised.append(e)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(limit_s)
    assert not thread.is_alive(), f"still blocked {limit_s:.0f} s after the worker died"
    return raised[0] if raised else None


def kill_during_step(llm: Any, step: int) -> Any:
    """At rank 0's step-th run(): stop rank 1 (SIGSTOP), so that rank 0 waits for it inside
    a collective (on the device under NCCL), and SIGKILL it half a second later.

    Returns rank 1's process; once killed, its attribute `killed_at` holds the time.
    """
    assert llm.engine_core.workers is not None
    worker = llm.engine_core.workers.worker_processes[0]
    original = llm.model_runner.run
    calls = 0

    def kill() -> None:
        os.kill(worker.pid, signal.SIGKILL)
        worker.killed_at = time.monotonic()

    def run(seqs: Any, is_prefill: bool) -> Any:
        nonlocal calls
        calls += 1
        if calls == step:
            os.kill(worker.pid, signal.SIGSTOP)
            threading.Timer(0.5, kill).start()
        return original(seqs, is_prefill)

    llm.model_runner.run = run
    return worker


def assert_stopped_for_good(llm: Any, prompt: list[int], params: Any, match: str) -> None:
    """No worker process and no process group left; every entry point refuses, naming why."""
    assert multiprocessing.active_children() == []
    assert not dist.is_initialized(), "the process group outlived the engine"
    for call in (lambda: llm.generate([prompt], params, use_tqdm=False),
                 lambda: llm.add_request(prompt, params), llm.step):
        with pytest.raises(EngineDeadError, match=match):
            call()
