"""Tensor-parallel worker processes: ranks 1..N-1 of the ModelRunner.

    Executor (rank 0)                          worker process (rank r)
    ------------------                         -----------------------
    spawn N-1 workers  ----------------------> import, report "alive" on its pipe
    init_process_group  <=== rendezvous ===>   init_process_group
    ModelRunner(rank 0)                        ModelRunner(rank r), report "ready" or the error
    call("initialize_cache")  -- pipe ------>  same method; warm-up and KV sizing meet in
                                               collectives (all_reduce MIN of the block count)
    call("run", seqs, is_prefill) -- pipe -->  run(seqs, is_prefill): every rank computes its
                                               shard; all_reduce / gather inside the layers;
                                               with async scheduling, a broadcast of rank 0's
                                               sampled tokens ends the step
    shutdown: "exit" -- pipe --------------->  leave the loop, destroy the process group
              destroy the process group <===>  (all ranks at once: NCCL waits for peers)

Commands travel over one multiprocessing Pipe per worker rather than a torch.distributed
broadcast: a worker waits for the next command for as long as the engine is idle, and a
collective would time out; a pipe also lets a worker report a start-up error instead of
leaving rank 0 stuck in a rendezvous. The tensors themselves only move in NCCL (GPU) or gloo
(CPU) collectives: inside the layers, and with async scheduling the sampled tokens, which the
next step may read before the host has seen them (ModelRunner.run).

Lifetime: workers are daemonic (multiprocessing ends them when the engine's process exits),
watch their parent and exit if it disappears, and WorkerPool.shutdown is registered with
weakref.finalize by the engine, so they end with exit(), garbage collection, or an error.
A worker that dies on its own is noticed by a watchdog thread of rank 0 (tp_watchdog.py),
which stops the others and, under NCCL, aborts the communicator so rank 0 stops waiting.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import socket
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import torch
import torch.distributed as dist

from myvllm.config import Config
from myvllm.engine.tp_watchdog import WorkerWatchdog

logger = logging.getLogger("myvllm")

# Collectives only wait while every rank is inside the same step, so a stuck peer is a bug:
# fail after this long instead of hanging forever. (A dead peer is noticed much sooner, by
# the watchdog: tp_watchdog.py.)
COLLECTIVE_TIMEOUT = timedelta(minutes=5)
START_TIMEOUT_S = 600.0


def pick_init_method() -> str:
    """MASTER_ADDR/MASTER_PORT when set (multi-host), else a free local port."""
    addr = os.environ.get("MASTER_ADDR")
    port = os.environ.get("MASTER_PORT")
    if addr and port:
        return f"tcp://{addr}:{port}"
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{sock.getsockname()[1]}"


def init_distributed(config: Config, rank: int, init_method: str, use_cuda: bool) -> None:
    # NCCL binds the group to this rank's GPU up front (no guessing at the first collective).
    device_id: dict[str, Any] = {"device_id": torch.device("cuda", rank)} if use_cuda else {}
    if use_cuda:
        # When a collective fails or times out, PyTorch's NCCL watchdog by default ends the
        # whole process. Rank 0 is the caller's process (a server, a notebook): "2" makes it
        # abort the communicator and leave the process alone; the engine reports the error.
        # Read when the group is created; a value the user set is kept.
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
    dist.init_process_group(
        backend="nccl" if use_cuda else "gloo",
        init_method=init_method,
        world_size=config.tensor_parallel_size,
        rank=rank,
        timeout=COLLECTIVE_TIMEOUT,
        **device_id,
    )


def exit_when_parent_dies(parent_pid: int, check_s: float = 1.0, who: str = "") -> None:
    """Run in a daemon thread: end this process (exit code 1) once its parent is gone, so a
    child never outlives whoever started it (a parent that was killed cannot stop it)."""
    while True:
        if os.getppid() != parent_pid:
            if who:
                logger.error(f"the parent process {parent_pid} is gone: {who} exits")
            os._exit(1)
        time.sleep(check_s)


def worker_main(config: Config, rank: int, init_method: str, model_path: str,
                use_cuda: bool, cpu_threads: int | None, conn: Connection,
                parent_pid: int) -> None:
    """Entry point of a worker process (must be importable: processes are spawned).
    cpu_threads: this rank's share of the cores on a CPU (engine/cpu_threads.py)."""
    threading.Thread(target=exit_when_parent_dies, args=(parent_pid,), daemon=True).start()
    if cpu_threads is not None:
        torch.set_num_threads(cpu_threads)
    from myvllm.engine.model_runner import ModelRunner  # after the thread cap is set

    runner = None
    try:
        conn.send(("alive", None))
        init_distributed(config, rank, init_method, use_cuda)
        runner = ModelRunner(config, rank, model_path)
        conn.send(("ready", None))
        while True:
            method, args = conn.recv()
            if method == "exit":
                break
            getattr(runner, method)(*args)
    except EOFError:
        pass  # the engine closed its end of the pipe: it is gone, so are we
    except BaseException:  # report any failure to rank 0, then exit non-zero
        try:
            conn.send(("error", traceback.format_exc()))
        except OSError:
            pass  # rank 0 already closed the pipe; the traceback is printed below anyway
        traceback.print_exc()
        os._exit(1)
    finally:
        if runner is not None:
            runner.release_cuda_graphs()  # before the group: see release_cuda_graphs
        if dist.is_initialized():
            dist.destroy_process_group()


class WorkerPool:
    """Rank 0's handle on the worker processes. Holds no reference to the engine."""

    def __init__(self, config: Config, model_path: str, init_method: str, use_cuda: bool,
                 cpu_threads: int | None = None) -> None:
        ctx = mp.get_context("spawn")
        self.processes: list[BaseProcess] = []
        self.conns: list[Connection] = []
        self.closed = False
        self.exit_requested = False
        for rank in range(1, config.tensor_parallel_size):
            parent_conn, child_conn = ctx.Pipe()
            process = ctx.Process(
                target=worker_main,
                args=(config, rank, init_method, model_path, use_cuda, cpu_threads, child_conn,
                      os.getpid()),
                daemon=True,
                name=f"myvllm-tp-worker-{rank}",
            )
            process.start()
            child_conn.close()
            self.processes.append(process)
            self.conns.append(parent_conn)
        self.watchdog = WorkerWatchdog(self.processes)

    @property
    def failure(self) -> str | None:
        """Why a worker ended on its own ("... rank 1 died (killed by SIGKILL)"), or None."""
        return self.watchdog.failure

    def wait_for(self, expected: str) -> None:
        """Block until every worker reported `expected`; raise with a worker's error."""
        deadline = time.monotonic() + START_TIMEOUT_S
        pending = set(range(len(self.conns)))
        while pending:
            for i in list(pending):
                conn = self.conns[i]
                if conn.poll(0.2):
                    try:
                        kind, detail = conn.recv()
                    except EOFError:  # poll() is also true at EOF: the worker died
                        failure = (self.watchdog.find_failure(wait_s=5.0)
                                   or f"tensor-parallel worker rank {i + 1} closed its pipe")
                        raise RuntimeError(f"{failure} during start-up") from None
                    if kind == "error":
                        raise RuntimeError(f"tensor-parallel worker rank {i + 1} failed to "
                                           f"start:\n{detail}")
                    if kind == expected:
                        pending.discard(i)
                elif self.failure is not None:
                    raise RuntimeError(f"{self.failure} during start-up")
            if time.monotonic() > deadline:
                raise RuntimeError(f"tensor-parallel workers {sorted(r + 1 for r in pending)} "
                                   f"did not report '{expected}' within {START_TIMEOUT_S:.0f} s")

    def send(self, method: str, *args: Any) -> None:
        for rank, conn in enumerate(self.conns, start=1):
            try:
                conn.send((method, args))
            except OSError as e:  # broken pipe: the worker is gone (killed, crashed)
                cause = (self.watchdog.find_failure(wait_s=5.0)
                         or f"tensor-parallel worker rank {rank} closed its pipe")
                raise RuntimeError(f"{cause}; this engine cannot continue") from e

    def reported_error(self) -> str | None:
        """The first error a worker sent since start-up (its traceback), without blocking.

        A worker that fails inside a step sends its traceback, then exits; rank 0 notices
        its death (the watchdog, or its own failed collective) and then asks here what
        really went wrong.
        """
        for rank, conn in enumerate(self.conns, start=1):
            try:
                while conn.poll(0):
                    kind, detail = conn.recv()
                    if kind == "error":
                        return f"rank {rank}:\n{detail}"
            except (EOFError, OSError):
                continue  # closed pipe and nothing left to read: that worker sent no error
        return None

    def all_alive(self) -> bool:
        """Every worker still running and not yet told to stop."""
        if self.exit_requested or self.failure is not None:
            return False
        with self.watchdog.lock:
            return all(p.is_alive() for p in self.processes)

    def request_exit(self) -> None:
        """Send "exit" to every worker without waiting (idempotent): each one leaves its
        loop and destroys its side of the process group while rank 0 destroys its own."""
        if self.exit_requested:
            return
        self.exit_requested = True
        self.watchdog.stop()  # the exits that follow are expected
        for conn in self.conns:
            try:
                conn.send(("exit", ()))
            except (OSError, ValueError):
                pass  # that worker is already gone; shutdown() reaps it

    def shutdown(self, wait_s: float = 5.0) -> None:
        """Ask workers to exit, wait up to wait_s, then terminate them (idempotent).

        After an error a worker may sit inside a collective that will never complete and
        cannot read the exit command: callers on that path pass wait_s=0.
        """
        if self.closed:
            return
        self.request_exit()
        self.closed = True
        with self.watchdog.lock:
            for process in self.processes:
                process.join(timeout=wait_s)
                if process.is_alive():
                    process.terminate()
                    process.join(timeout=5)
                if process.is_alive():
                    process.kill()
                    process.join()
        for conn in self.conns:
            conn.close()


def nccl_abort() -> Callable[[], None] | None:
    """What the watchdog calls when a worker dies: abort this rank's NCCL communicators.

    ProcessGroup.abort works from any thread and only touches the C++ side (the Python
    bookkeeping of the group is left to release_process_group on the main thread). NCCL sets
    its abort flag first, so the kernels spinning in a collective return at once; the rest of
    the abort waits until rank 0 has dropped its CUDA graphs (GraphCache.release), which
    captured NCCL kernels of this communicator.
    """
    group = dist.group.WORLD
    abort: Callable[[], None] | None = getattr(group, "abort", None)
    if abort is None:
        logger.warning("This torch cannot abort an NCCL process group: a dead worker is "
                       "noticed only at the collective timeout.")
    return abort


def release_process_group(graceful: bool) -> None:
    """Destroy this rank's side of the process group.

    Graceful: every rank is doing the same at this moment (rank 0 sent "exit" first). NCCL's
    teardown waits for its peers, so rank 0 must not wait for the workers to finish first;
    seen on two H200s: rank 0 destroying after the workers had been reaped hung for good.
    Not graceful (a worker died, or was stopped mid-collective): NCCL would wait for the
    missing peer forever, so abort the communicators instead (again, if the watchdog did
    already: a second abort of a communicator returns at once) and drop the group's
    bookkeeping, so that a new engine can create a group; gloo's teardown is local.
    """
    if graceful or dist.get_backend() != "nccl":
        dist.destroy_process_group()
        return
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort is None:  # torch < 2.6: leave the group; the process exit releases it
        logger.warning("This torch cannot abort an NCCL process group; it stays initialized "
                       "until the process exits.")
        return
    try:
        abort()
    except Exception:  # the engine's own error matters more; this one is logged
        logger.exception("Aborting the NCCL process group failed; a new tensor-parallel "
                         "engine in this process may fail to start.")
