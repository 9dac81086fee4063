"""Rank 0 notices a dead tensor-parallel worker within a second, whatever it was doing.

Without this, a worker killed mid-step (SIGKILL, the out-of-memory killer, a crash) leaves
the others waiting for it: under gloo a collective fails once the dead peer's socket closes,
but the surviving workers of a larger group go on waiting in theirs; under NCCL the GPU kernel
of the collective spins until NCCL's own timeout (minutes) while rank 0's host thread waits
on the device (seen on two H200s: rank 0 still waiting 90 s after rank 1 was killed).

    watchdog thread (rank 0)                     main thread (rank 0)
    ------------------------                     --------------------
    wait on every worker's sentinel              run a step: send the command, compute,
      (an fd that closes when the process          collectives with the workers, wait
       ends; no polling)                           for the sampled tokens
    a worker ended and no exit was asked for:
      record "rank r died (killed by SIGKILL)"
      kill the other workers                 -->  gloo: every peer's socket is closed, the
                                                  collective raises
      NCCL: abort the communicator           -->  the spinning kernels see NCCL's abort flag
                                                  and return, so the wait on the device
                                                  ends (with garbage)
                                                  either way: the engine reads the recorded
                                                  death and raises it
                                                  (Executor.watching_workers)

The abort does not depend on NCCL noticing anything itself, nor on its timeout.

Workers that torchrun started (executor/tp_launch.py) are no children of rank 0: each is watched
through its liveness connection instead of a sentinel (tp_launch.RemoteWorker), and "killing"
one closes that connection, on which the worker ends itself.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable, Sequence
from multiprocessing.connection import wait
from typing import Any, Protocol

logger = logging.getLogger("myvllm")

# How often the watchdog thread checks whether it was told to stop (a worker's death wakes it
# at once; this only bounds how long it outlives the pool).
STOP_CHECK_S = 1.0


def describe_exit(exitcode: int | None) -> str:
    """A worker process's end in words, from multiprocessing's exitcode (-N: signal N)."""
    if exitcode is None:
        return "exit status unknown"
    if exitcode >= 0:
        return f"exited with code {exitcode}"
    try:
        name = signal.Signals(-exitcode).name
    except ValueError:
        name = f"signal {-exitcode}"
    if -exitcode == signal.SIGKILL:
        # The kernel's out-of-memory killer ends a process with SIGKILL: the most common
        # reason a worker vanishes without a traceback.
        return f"killed by {name}; the out-of-memory killer also sends SIGKILL"
    return f"killed by {name}"


class WorkerProcess(Protocol):
    """What the watchdog and WorkerPool use of a worker: a multiprocessing process (spawned
    here) or a tp_launch.RemoteWorker (started by torchrun, maybe on another host)."""

    @property
    def name(self) -> str: ...

    @property
    def sentinel(self) -> Any: ...  # what multiprocessing.connection.wait waits on

    @property
    def exitcode(self) -> int | None: ...

    def is_alive(self) -> bool: ...

    def join(self, timeout: float | None = None) -> None: ...

    def terminate(self) -> None: ...

    def kill(self) -> None: ...


def describe_end(process: WorkerProcess) -> str:
    """How a worker ended, in words: its exit code or signal, or what a remote one can say."""
    describe: Callable[[], str] | None = getattr(process, "describe_end", None)
    return describe() if describe is not None else describe_exit(process.exitcode)


class WorkerWatchdog:
    """Watches the worker processes of one WorkerPool from a daemon thread of rank 0.

    The first worker that ends without being asked to is recorded in `failure`; the others
    are killed and `on_death` (the NCCL abort, when there is one) is called. `lock` guards
    every reap or signal of the processes, here and in WorkerPool: multiprocessing's
    Process.join/is_alive are not meant to race each other from two threads.
    """

    def __init__(self, processes: Sequence[WorkerProcess]) -> None:
        self.processes = processes
        self.failure: str | None = None
        self.lock = threading.Lock()
        self._stopped = threading.Event()
        self._on_death: Callable[[], None] | None = None
        self._thread = threading.Thread(target=self._run, name="myvllm-tp-watchdog",
                                        daemon=True)
        self._thread.start()

    def call_on_death(self, callback: Callable[[], None]) -> None:
        """Run callback on the watchdog thread after a death (once the group exists)."""
        self._on_death = callback

    def stop(self) -> None:
        """From now on the workers are expected to exit: record nothing (idempotent)."""
        self._stopped.set()

    def find_failure(self, wait_s: float) -> str | None:
        """The recorded death, or one that happens within wait_s.

        Rank 0 often learns of a death from its own failed collective (gloo) a moment
        before the watchdog thread runs: this waits on the same sentinels.
        """
        if self.failure is None:
            sentinels = {p.sentinel: rank for rank, p in enumerate(self.processes, start=1)}
            ready = wait(list(sentinels), timeout=wait_s)
            if ready:
                self._record(min(sentinels[s] for s in ready))
        return self.failure

    # ------------------------------------------------------------------ watchdog thread
    def _run(self) -> None:
        sentinels = {p.sentinel: rank for rank, p in enumerate(self.processes, start=1)}
        while not self._stopped.is_set():
            ready = wait(list(sentinels), timeout=STOP_CHECK_S)
            if ready and not self._stopped.is_set():
                self._handle_death(min(sentinels[s] for s in ready))
                return

    def _record(self, rank: int) -> str:
        with self.lock:
            process = self.processes[rank - 1]
            process.join(timeout=5)  # its sentinel closed: reaping it is immediate
            if self.failure is None:
                self.failure = (f"tensor-parallel worker rank {rank} died "
                                f"({describe_end(process)})")
                logger.error(self.failure)
            return self.failure

    def _handle_death(self, rank: int) -> None:
        self._record(rank)
        with self.lock:
            for process in self.processes:
                if process.is_alive():
                    process.kill()
        if self._on_death is not None:
            try:
                self._on_death()
            except Exception:  # the death is recorded either way; rank 0 still raises it
                logger.exception("aborting the process group after a worker died failed")
