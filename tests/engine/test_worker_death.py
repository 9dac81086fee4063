"""A tensor-parallel worker that dies mid-generate fails the call at once, never hangs it.

    the watchdog alone (quick)   a process killed -> recorded with its signal, the others
                                 killed, the abort callback run; an expected exit -> nothing
    SIGKILL mid-step (gloo)      rank 0 waits in a collective for a stopped worker, which
                                 is then killed: EngineDeadError naming rank 1 and SIGKILL;
                                 no worker and no process group left; generate, add_request
                                 and step refused; a new engine in the same process gives
                                 the same tokens (checked after the async case, whose dead
                                 engine had a step in flight and the next one queued, more
                                 to leave behind than the sync case's one step; tests/gpu/
                                 does the same over NCCL)
    exit code mid-step           a worker that exits with code 7 is reported with its code

Both mid-step cases run with and without async scheduling (a step in flight while the next
is queued).

"Never hangs" is checked by running the call in a thread and failing the test if it is
still blocked after HANG_LIMIT_S (helpers_workers.py), far above the watchdog's bound of
about a second.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from typing import Any

import pytest
from helpers_models import tiny_checkpoint
from helpers_workers import (HANG_LIMIT_S, assert_stopped_for_good, kill_during_step,
                             returns_within)

from myvllm import LLM, SamplingParams
from myvllm.executor.errors import EngineDeadError
from myvllm.executor.tp_watchdog import WorkerWatchdog, describe_exit

ENGINE_KW: dict[str, Any] = dict(block_size=4, max_model_length=64, max_num_batched_tokens=64)
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
PROMPTS = [[11, 12, 13, 14, 15], [21, 22, 23]]


# ================================================================== the watchdog alone
def test_describe_exit() -> None:
    assert describe_exit(3) == "exited with code 3"
    assert describe_exit(-signal.SIGSEGV) == "killed by SIGSEGV"
    assert describe_exit(-signal.SIGKILL).startswith("killed by SIGKILL; the out-of-memory")


def _sleepers(n: int) -> list[Any]:
    ctx = multiprocessing.get_context("spawn")
    processes = [ctx.Process(target=time.sleep, args=(60,), daemon=True) for _ in range(n)]
    for process in processes:
        process.start()
    return processes


def test_watchdog_records_a_death_and_stops_the_others() -> None:
    processes = _sleepers(2)
    watchdog = WorkerWatchdog(processes)
    aborted = threading.Event()
    watchdog.call_on_death(aborted.set)
    assert watchdog.failure is None
    os.kill(processes[1].pid, signal.SIGKILL)  # rank 2 (ranks start at 1 here)
    assert aborted.wait(HANG_LIMIT_S), "the death was not noticed"
    assert watchdog.failure is not None
    assert watchdog.failure.startswith("tensor-parallel worker rank 2 died (killed by SIGKILL")
    processes[0].join(HANG_LIMIT_S)
    assert processes[0].exitcode == -signal.SIGKILL  # the survivor was stopped
    assert multiprocessing.active_children() == []


def test_watchdog_ignores_exits_it_was_told_about() -> None:
    processes = _sleepers(1)
    watchdog = WorkerWatchdog(processes)
    called = threading.Event()
    watchdog.call_on_death(called.set)
    watchdog.stop()
    processes[0].terminate()
    processes[0].join(HANG_LIMIT_S)
    watchdog._thread.join(HANG_LIMIT_S)  # it ends within STOP_CHECK_S of stop()
    assert not watchdog._thread.is_alive()
    assert watchdog.failure is None and not called.is_set()


# ================================================================== a whole engine (gloo)
@pytest.fixture(scope="module")
def path() -> str:
    return str(tiny_checkpoint("llama"))


@pytest.mark.slow
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_sigkill_mid_generate_fails_fast_and_a_new_engine_works(path: str,
                                                                async_scheduling: bool) -> None:
    llm = LLM(path, tensor_parallel_size=2, async_scheduling=async_scheduling, **ENGINE_KW)
    expected = [o["token_ids"] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    worker = kill_during_step(llm, step=4)  # a decode step
    error = returns_within(lambda: llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    assert isinstance(error, EngineDeadError), repr(error)
    assert isinstance(error, RuntimeError)
    assert "tensor-parallel worker rank 1 died (killed by SIGKILL" in str(error)
    assert worker.exitcode == -signal.SIGKILL
    assert_stopped_for_good(llm, PROMPTS[0], GREEDY, r"rank 1 died \(killed by SIGKILL")
    assert not llm.scheduler.waiting and not llm.scheduler.running
    if not async_scheduling:
        return  # one engine started less: the async case, which leaves the most behind, checks it

    # Fresh workers, a fresh process group on a new port: nothing of the dead engine left.
    again = LLM(path, tensor_parallel_size=2, **ENGINE_KW)
    assert [o["token_ids"] for o in again.generate(PROMPTS, GREEDY, use_tqdm=False)] == expected
    again.exit()
    assert multiprocessing.active_children() == []


class ExitOnArrival:
    """Unpickled by the worker as os._exit(code): a worker that crashes with an exit code
    the moment it receives a step, as a C-level fatal error would."""

    def __init__(self, code: int) -> None:
        self.code = code

    def __reduce__(self) -> tuple[Any, tuple[int]]:
        return os._exit, (self.code,)


@pytest.mark.slow
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_worker_exiting_with_a_code_mid_generate(path: str, async_scheduling: bool) -> None:
    # With async scheduling, step 3 is queued while step 2 is still in flight.
    llm = LLM(path, tensor_parallel_size=2, async_scheduling=async_scheduling, **ENGINE_KW)
    pool = llm.engine_core.workers._pool
    assert pool is not None
    original_send = pool.send
    runs = 0

    def send(method: str, *args: Any) -> None:
        nonlocal runs
        runs += method == "run"
        if runs == 3:
            return original_send(method, ExitOnArrival(7))
        return original_send(method, *args)

    pool.send = send  # type: ignore[method-assign]
    error = returns_within(lambda: llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    assert isinstance(error, EngineDeadError), repr(error)
    assert "tensor-parallel worker rank 1 died (exited with code 7) during run()" in str(error)
    assert_stopped_for_good(llm, PROMPTS[0], GREEDY, r"rank 1 died \(exited with code 7\)")
