"""The Executor of tensor parallelism: the worker processes and rank 0's ModelRunner beside
them. The EngineCore makes one only when tensor_parallel_size > 1 (with one rank it holds
its ModelRunner itself, and none of this runs).

    Executor(config, model_path, hf_config, use_cuda, cpu_threads)
      spawn N-1 workers (tp_workers.py), join the process group as rank 0, build
             rank 0's ModelRunner, wait until every worker has built its own
      under torchrun (every rank started by it, on one host or several): rank 0 joins the
             group and the other ranks connect to it (tp_launch.py); on ranks 1..N-1 the
             Executor never returns: it serves rank 0's calls, then ends the process
    call("run", seqs, is_prefill)    the same ModelRunner method on every rank
    dead_reason / check_alive()      a worker died or a step failed: no more steps
    shutdown()                       workers and process group released; idempotent

Under tensor parallelism the engine core talks to the model only through call(), so it needs
to know nothing about processes, pipes, NCCL or what happens when a worker dies: all of that
lives here.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

from myvllm.config import Config
from myvllm.executor import sequence_pickling
from myvllm.executor.errors import EngineDeadError
from myvllm.engine.model_runner import ModelRunner
from myvllm.executor.tp_workers import (WorkerPool, init_distributed, nccl_abort,
                                      pick_init_method, release_process_group,
                                      run_launched_worker)
from myvllm.utils.distributed import check_torchrun_world_size, torchrun_env
from myvllm.worker.staging import SampledTokens

logger = logging.getLogger("myvllm")

# After rank 0's side of a step failed: how long to wait for a worker's death to explain it
# (a worker that raised sends its traceback, then exits; a killed one is usually gone already).
WORKER_EXIT_WAIT_S = 2.0


def _shutdown(pool: WorkerPool | None, runner: ModelRunner | None = None,
              graceful: bool = True) -> None:
    """Release workers and the process group; safe to call twice (weakref.finalize runs it
    at most once).

    graceful=False after an error: a worker may be stuck in a collective, so the workers are
    stopped first and the group is aborted rather than torn down together.
    """
    graceful = graceful and (pool is None or pool.all_alive())
    if pool is not None:
        if graceful:
            pool.request_exit()  # the workers destroy their side while we destroy ours
        else:
            pool.shutdown(wait_s=0)
    if dist.is_initialized():
        if runner is not None:
            runner.graphs.release(runner.device)  # before the group: see GraphCache.release
        release_process_group(graceful)
    if pool is not None:
        pool.shutdown()


class Executor:
    def __init__(self, config: Config, model_path: str, hf_config: Any, use_cuda: bool,
                 cpu_threads: int | None) -> None:
        """cpu_threads: each rank's share of the cores on a CPU (worker/cpu_threads.py; this
        process already runs with it), None on GPUs."""
        assert config.tensor_parallel_size > 1, "one rank needs no Executor"
        self._dead_reason: str | None = None  # set when a tensor-parallel step fails
        sequence_pickling.register()  # a step's sequences reach the workers as worker copies
        launch = torchrun_env()
        check_torchrun_world_size(launch, config.tensor_parallel_size)
        if launch is not None and launch.rank != 0:
            # This process is a worker of rank 0's engine, not an engine: the same script or
            # command runs on every rank, so LLM(...) here serves rank 0 and then ends.
            raise SystemExit(run_launched_worker(config, launch, model_path, use_cuda))
        pool: WorkerPool | None = None
        runner: ModelRunner | None = None
        try:
            if launch is not None:
                init_distributed(config, 0, "env://", use_cuda)
                pool = WorkerPool.connect(config, launch, cpu_threads)
            else:
                init_method = pick_init_method()
                pool = WorkerPool.spawn(config, model_path, init_method, use_cuda, cpu_threads)
                pool.wait_for("alive")
                init_distributed(config, 0, init_method, use_cuda)
            abort = nccl_abort() if use_cuda else None
            if abort is not None:  # gloo needs none: a dead peer's sockets close
                pool.watchdog.call_on_death(abort)
            runner = ModelRunner(config, 0, model_path, hf_config)
            pool.wait_for("ready")
        except BaseException:
            _shutdown(pool, runner, graceful=False)
            raise
        self._pool = pool
        self.model_runner = runner
        # Runs on shutdown(), on garbage collection, and at interpreter exit, whichever is
        # first. The runner's graphs must go before the process group.
        self._finalizer = weakref.finalize(self, _shutdown, pool, runner)

    @property
    def worker_processes(self) -> list[Any]:
        """The tensor-parallel worker processes (rank 1 first)."""
        return list(self._pool.processes)

    def call(self, method: str, *args: Any) -> Any:
        """Run a ModelRunner method on every rank (workers first, they block on NCCL/gloo);
        returns rank 0's result."""
        self.check_alive()
        with self.watching_workers(method):
            self._pool.send(method, *args)
            return getattr(self.model_runner, method)(*args)

    def token_ids(self, sampled: SampledTokens) -> list[int]:
        """Rank 0's wait for a step's tokens, which may wait for a peer: a death raises."""
        with self.watching_workers("run"):
            return sampled.token_ids()

    @contextlib.contextmanager
    def watching_workers(self, method: str) -> Iterator[None]:
        """Rank 0's part of a collective step; a worker's death or error is raised from it.

        A dead worker makes rank 0's part fail (gloo: the peer's socket closed) or return
        early with garbage (NCCL: the watchdog aborted the communicator, tp_watchdog.py).
        Either way the worker's death, and its traceback if it sent one, is what the caller
        sees, and the executor stops: the ranks are out of step for good.
        """
        pool = self._pool
        try:
            yield
        except Exception as e:
            death = pool.watchdog.find_failure(wait_s=WORKER_EXIT_WAIT_S)
            traceback = pool.reported_error()
            if death is None and traceback is None:
                raise  # rank 0's own error: the caller still stops the workers
            raise self._worker_failed(method, death, traceback) from e
        if pool.failure is not None:  # returned, but after the abort: nothing in it is true
            raise self._worker_failed(method, pool.failure, pool.reported_error())

    def _worker_failed(self, method: str, death: str | None,
                       traceback: str | None) -> EngineDeadError:
        """Stop the workers after one failed in `method`; the error to raise."""
        message = death or "a tensor-parallel worker failed"
        self._dead_reason = message
        self.shutdown()
        detail = f":\n{traceback}" if traceback else ""
        return EngineDeadError(f"{message} during {method}(); this engine stopped its "
                               f"workers and cannot continue (build a new one){detail}")

    @property
    def dead_reason(self) -> str | None:
        """Why no more steps can run, or None while they can: a worker died (noticed by the
        watchdog even while the engine is idle), a step failed, or shutdown() was called.
        (One process has nothing to get out of step: the EngineCore of one rank has no
        Executor, and keeps working after an error.)"""
        if self._dead_reason is not None:
            return self._dead_reason
        if self._pool.failure is not None:
            return self._pool.failure
        if self._pool.closed:
            return "this engine was shut down (exit() or an earlier failure)"
        return None

    def check_alive(self) -> None:
        """Raise EngineDeadError if no more steps can run (see dead_reason)."""
        reason = self.dead_reason
        if reason is None:
            return
        self.shutdown()  # a worker that died while the engine was idle: stop the others now
        raise EngineDeadError(f"This engine cannot run: {reason}. Build a new engine.")

    def stop_workers_now(self) -> None:
        """After an interrupted step: the ranks may have stopped in different places (one
        inside a collective), so stop the workers without waiting."""
        self._pool.shutdown(wait_s=0)
        self.shutdown()

    def shutdown(self) -> None:
        """Stop the worker processes and release the process group (idempotent)."""
        self._finalizer()
