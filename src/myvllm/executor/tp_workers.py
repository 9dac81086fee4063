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
A worker told to exit destroys its side of the group and ends its process at once, without
the interpreter's exit (utils/process_exit.py), so rank 0's shutdown does not wait for it.
A worker that dies on its own is noticed by a watchdog thread of rank 0 (tp_watchdog.py),
which stops the others and, under NCCL, aborts the communicator so rank 0 stops waiting.

Under torchrun (RANK, WORLD_SIZE, LOCAL_RANK in the environment) nothing is spawned: torchrun
starts every rank, on every host, and ranks 1..N-1 run run_launched_worker, the same loop,
with TCP connections to rank 0 in place of the pipes (tp_launch.py says how they meet and how
each side notices the other's end). The rendezvous is then torchrun's (env://).
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
from typing import TYPE_CHECKING, Any, NoReturn

import torch
import torch.distributed as dist

from myvllm.config import Config
from myvllm.executor.tp_launch import (connect_to_rank_0, connect_workers,
                                     exit_when_rank_0_leaves, hang_up)
from myvllm.executor.tp_watchdog import WorkerProcess, WorkerWatchdog
from myvllm.utils.distributed import (TorchrunEnv, init_all_reduce, local_device_index,
                                      release_all_reduce)
from myvllm.utils.process_exit import exit_without_finalizing

if TYPE_CHECKING:
    from myvllm.engine.model_runner import ModelRunner

logger = logging.getLogger("myvllm")

# Collectives only wait while every rank is inside the same step, so a stuck peer is a bug:
# fail after this long instead of hanging forever. (A dead peer is noticed much sooner, by
# the watchdog: tp_watchdog.py.)
COLLECTIVE_TIMEOUT = timedelta(minutes=5)
START_TIMEOUT_S = 600.0


def pick_init_method() -> str:
    """The rendezvous of workers spawned on this host: MASTER_ADDR/MASTER_PORT when set, else
    a free local port. (A torchrun launch meets through torchrun's own store: env://.)"""
    addr = os.environ.get("MASTER_ADDR")
    port = os.environ.get("MASTER_PORT")
    if addr and port:
        return f"tcp://{addr}:{port}"
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{sock.getsockname()[1]}"


def init_distributed(config: Config, rank: int, init_method: str, use_cuda: bool) -> None:
    # NCCL binds the group to this rank's GPU up front (no guessing at the first collective).
    device_id: dict[str, Any] = ({"device_id": torch.device("cuda", local_device_index(rank))}
                                 if use_cuda else {})
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
    # Before any model or graph: the symmetric buffers are exchanged once, here.
    init_all_reduce(device_id.get("device_id", torch.device("cpu")),
                    enable=not config.disable_custom_all_reduce)


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
                parent_pid: int) -> NoReturn:
    """Entry point of a worker process (must be importable: processes are spawned); it ends
    the process, with code 0 once rank 0 asked it to exit or closed its pipe.
    cpu_threads: this rank's share of the cores on a CPU (worker/cpu_threads.py)."""
    threading.Thread(target=exit_when_parent_dies, args=(parent_pid,), daemon=True).start()
    if cpu_threads is not None:
        torch.set_num_threads(cpu_threads)
    from myvllm.engine.model_runner import ModelRunner  # after the thread cap is set

    def start() -> ModelRunner:
        conn.send(("alive", None))
        init_distributed(config, rank, init_method, use_cuda)
        return ModelRunner(config, rank, model_path)

    serve_rank_0(conn, start)  # returns on "exit" or a closed pipe, or ends the process
    # The group is destroyed: what is left is the interpreter's exit (a second or two on a
    # busy CPU), which rank 0's shutdown would wait for.
    exit_without_finalizing()


def run_launched_worker(config: Config, env: TorchrunEnv, model_path: str,
                        use_cuda: bool) -> int:
    """Rank env.rank of a torchrun launch: join the group, connect to rank 0, serve its calls;
    the exit code: 0 when rank 0 asked this rank to exit, 1 when rank 0 disappeared or this
    rank failed (the liveness thread or serve_rank_0 may end the process with it first).

    config is this process's own (its command line): it picks the backend. The ModelRunner is
    built from rank 0's resolved config, which rank 0 sends first, so that every setting the
    shapes depend on (max_model_length, eos) is the same on every rank; model_path is the
    same model found on this host.
    """
    init_distributed(config, env.rank, "env://", use_cuda)
    commands, liveness = connect_to_rank_0(env)
    exiting = threading.Event()
    threading.Thread(target=exit_when_rank_0_leaves, args=(liveness, exiting, env.rank),
                     daemon=True, name="myvllm-rank-0-watch").start()
    from myvllm.engine.model_runner import ModelRunner

    def start() -> ModelRunner:
        kind, detail = commands.recv()
        if kind != "start":
            raise RuntimeError(f"rank 0 sent {kind!r} before 'start': a rank 0 of another "
                               "version of this engine?")
        rank_0_config, cpu_threads = detail
        mismatch = [f"{name}: {getattr(config, name)!r} here, {getattr(rank_0_config, name)!r} "
                    f"on rank 0" for name in ("tensor_parallel_size", "device")
                    if getattr(config, name) != getattr(rank_0_config, name)]
        if mismatch:
            raise RuntimeError(f"rank {env.rank} was started with other settings than rank 0 "
                               f"({'; '.join(mismatch)}): torchrun must run the same command "
                               "on every host")
        if cpu_threads is not None:
            torch.set_num_threads(cpu_threads)
        return ModelRunner(rank_0_config, env.rank, model_path)

    asked_to_exit = serve_rank_0(commands, start, exiting)
    # Done with the group: tell rank 0 now rather than at the end of this interpreter's exit
    # (seconds on a busy host; rank 0's shutdown waits for it).
    hang_up(liveness)
    return 0 if asked_to_exit else 1


def serve_rank_0(conn: Connection, start: Callable[[], ModelRunner],
                 exiting: threading.Event | None = None) -> bool:
    """The worker loop: build this rank's runner (start), report "ready", then run each
    method rank 0 sends until "exit" (returns True) or until rank 0 closes the connection
    (False). Any failure is reported to rank 0 (its traceback), then the process ends with
    code 1."""
    runner = None
    asked_to_exit = False
    try:
        runner = start()
        conn.send(("ready", None))
        while True:
            method, args = conn.recv()
            if method == "exit":
                asked_to_exit = True
                if exiting is not None:
                    exiting.set()  # rank 0 closing its connections is expected from now on
                break
            getattr(runner, method)(*args)
    except EOFError:
        pass  # the engine closed its end of the connection: it is gone, so are we
    except BaseException:  # report any failure to rank 0, then exit non-zero
        try:
            conn.send(("error", traceback.format_exc()))
        except OSError:
            pass  # rank 0 already closed the pipe; the traceback is printed below anyway
        traceback.print_exc()
        os._exit(1)
    finally:
        if runner is not None:
            runner.graphs.release(runner.device)  # before the group: see GraphCache.release
        if dist.is_initialized():
            release_all_reduce()
            dist.destroy_process_group()
    return asked_to_exit


class WorkerPool:
    """Rank 0's handle on the worker processes. Holds no reference to the engine.

    spawn(): this host's processes over pipes; connect(): torchrun's ranks over TCP.
    """

    def __init__(self, processes: list[WorkerProcess], conns: list[Connection]) -> None:
        self.processes = processes
        self.conns = conns  # rank 1 first
        self.closed = False
        self.exit_requested = False
        self.watchdog = WorkerWatchdog(self.processes)

    @classmethod
    def spawn(cls, config: Config, model_path: str, init_method: str, use_cuda: bool,
              cpu_threads: int | None = None) -> WorkerPool:
        ctx = mp.get_context("spawn")
        processes: list[WorkerProcess] = []
        conns: list[Connection] = []
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
            processes.append(process)
            conns.append(parent_conn)
        return cls(processes, conns)

    @classmethod
    def connect(cls, config: Config, env: TorchrunEnv,
                cpu_threads: int | None = None) -> WorkerPool:
        """Rank 0 of a torchrun launch, after init_process_group: the other ranks connect,
        and each gets this config (resolved: max_model_length, eos) and its thread count."""
        conns, workers = connect_workers(env, START_TIMEOUT_S)
        for conn in conns:
            conn.send(("start", (config, cpu_threads)))
        return cls(list(workers), conns)

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
    release_all_reduce()
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
