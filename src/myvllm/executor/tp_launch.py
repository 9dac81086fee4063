"""Ranks started by torchrun, on one host or several: how rank 0 and the workers find each
other, and how each notices that the other is gone.

    rank 0 (the engine)                         rank r (a worker, maybe on another host)
    -------------------                         ----------------------------------------
    init_process_group(env://)  <== torchrun's store at MASTER_ADDR:MASTER_PORT ==>  same
    listen on a free TCP port; put the port
      and a random key in the store    ----->   read them; connect twice to MASTER_ADDR:port
    accept both connections of every rank        commands: the calls, and "ready" / "error"
                                                 liveness: nothing is ever sent on it
    WorkerPool over the commands connections     serve rank 0's calls (tp_workers.py)

Why TCP connections and not the process group: a worker waits for its next call for as long
as the engine is idle (a server with no requests), and a collective would time out; a
connection also carries a worker's traceback back to rank 0, as the local workers' pipes do.
multiprocessing's Connection over TCP has the pipe's API (send, recv, poll), so WorkerPool and
the worker loop are the same code for spawned and for launched workers. The key (HMAC
challenge, multiprocessing's authkey) keeps other clients of the network from sending calls;
like torch.distributed's own store, the channel assumes a trusted network.

Why a second connection per worker: the first is read by one thread at a time (rank 0's main
thread, the worker's loop). The liveness connection is only ever waited on, by rank 0's
watchdog (tp_watchdog.py: it is the RemoteWorker's sentinel) and by a thread of the worker, and
it becomes readable only when the other end closes: a process that ends, however it ends, has
its sockets closed by its kernel. A host that vanishes closes nothing, so both ends turn on TCP
keepalive: the connection fails after about KEEPALIVE_IDLE_S + KEEPALIVE_COUNT x
KEEPALIVE_INTERVAL_S seconds of silence from the peer's kernel.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from multiprocessing.connection import Client, Connection, Listener, wait

import torch.distributed as dist

from myvllm.utils.distributed import TorchrunEnv

logger = logging.getLogger("myvllm")

STORE_KEY = "myvllm/rank0_listener"  # "<port> <hex key>", written by rank 0
KEEPALIVE_IDLE_S = 5
KEEPALIVE_INTERVAL_S = 2
KEEPALIVE_COUNT = 5
# After rank 0 asked a worker to exit, how long the worker may take to tear down its side of
# the process group before its liveness thread ends it anyway.
EXIT_GRACE_S = 30.0

_launched_engine_started = False  # one engine per torchrun launch (see connect_workers)


def set_keepalive(conn: Connection) -> None:
    """TCP keepalive on conn's socket, so that a peer host that vanishes fails it."""
    sock = socket.socket(fileno=os.dup(conn.fileno()))  # a second handle on the same socket
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for name, value in (("TCP_KEEPIDLE", KEEPALIVE_IDLE_S),
                            ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
                            ("TCP_KEEPCNT", KEEPALIVE_COUNT)):
            if hasattr(socket, name):  # Linux; elsewhere the system's (longer) defaults
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
    finally:
        sock.close()


def hang_up(conn: Connection) -> None:
    """End the connection for both sides (TCP shutdown: the peer reads the end of it) without
    closing this side's handle, which another thread may be waiting on at this moment: the
    handle stays valid (and readable) until it is dropped."""
    sock = socket.socket(fileno=os.dup(conn.fileno()))
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # the connection is already gone (the peer ended first)
    finally:
        sock.close()


class RemoteWorker:
    """Rank 0's handle on a worker it did not start: what WorkerPool and the watchdog ask of
    a process (sentinel, is_alive, join, kill), answered from its liveness connection."""

    exitcode = None  # another host's process: its exit status never reaches us

    def __init__(self, rank: int, liveness: Connection) -> None:
        self.rank = rank
        self.name = f"myvllm-tp-worker-{rank} (torchrun)"
        self.sentinel = liveness  # multiprocessing.connection.wait takes a Connection
        self._ended = False

    def is_alive(self) -> bool:
        if not self._ended and self.sentinel.poll(0):
            self._ended = True  # readable: the worker closed it (nothing else is sent)
        return not self._ended

    def join(self, timeout: float | None = None) -> None:
        if self.is_alive() and wait([self.sentinel], timeout):
            self._ended = True

    def kill(self) -> None:
        """Hang up rank 0's end: the worker's liveness thread then ends its process."""
        self._ended = True
        hang_up(self.sentinel)

    terminate = kill

    def describe_end(self) -> str:
        return ("its connection to rank 0 closed: the process ended, or its host stopped "
                "answering; its exit status is in torchrun's log on its host")


def connect_workers(env: TorchrunEnv, timeout_s: float
                    ) -> tuple[list[Connection], list[RemoteWorker]]:
    """Rank 0, after init_process_group: the commands connection and the handle of every
    worker (rank 1 first). Raises if some rank has not connected within timeout_s."""
    global _launched_engine_started
    if _launched_engine_started:
        # The workers served the first engine and exited with it.
        raise RuntimeError("this torchrun launch already ran an engine: its other ranks "
                           "exited with it; start a new torchrun launch for a new engine")
    _launched_engine_started = True
    authkey = os.urandom(32)
    listener = Listener(("0.0.0.0", 0), family="AF_INET", authkey=authkey)
    port = listener.address[1]
    store = dist.distributed_c10d._get_default_store()
    store.set(STORE_KEY, f"{port} {authkey.hex()}")
    commands: dict[int, Connection] = {}
    liveness: dict[int, Connection] = {}
    failure: list[BaseException] = []

    def accept_all() -> None:
        try:
            while len(commands) + len(liveness) < 2 * (env.world_size - 1):
                conn = listener.accept()
                kind, rank = conn.recv()
                set_keepalive(conn)
                (commands if kind == "commands" else liveness)[rank] = conn
        except BaseException as e:  # the listener closed below, or a bad client
            failure.append(e)

    thread = threading.Thread(target=accept_all, name="myvllm-tp-accept", daemon=True)
    thread.start()
    thread.join(timeout_s)
    listener.close()  # the accepting thread, if still waiting, fails and ends
    missing = sorted(set(range(1, env.world_size)) - (commands.keys() & liveness.keys()))
    if missing:
        detail = f" ({failure[0]!r})" if failure and not thread.is_alive() else ""
        raise RuntimeError(f"torchrun ranks {missing} did not connect to rank 0 at "
                           f"{env.master_addr}:{port} within {timeout_s:.0f} s{detail}")
    ranks = range(1, env.world_size)
    return [commands[r] for r in ranks], [RemoteWorker(r, liveness[r]) for r in ranks]


def connect_to_rank_0(env: TorchrunEnv) -> tuple[Connection, Connection]:
    """A worker, after init_process_group: (commands, liveness) connections to rank 0.
    Waits (up to the process group's timeout) until rank 0 has published its port."""
    store = dist.distributed_c10d._get_default_store()
    port_text, key_hex = store.get(STORE_KEY).decode().split()
    address = (env.master_addr, int(port_text))
    connections = []
    for kind in ("commands", "liveness"):
        conn = Client(address, family="AF_INET", authkey=bytes.fromhex(key_hex))
        conn.send((kind, env.rank))
        set_keepalive(conn)
        connections.append(conn)
    return connections[0], connections[1]


def exit_when_rank_0_leaves(liveness: Connection, exiting: threading.Event, rank: int) -> None:
    """Run in a daemon thread of a worker: end this process once rank 0's end of the liveness
    connection closes (rank 0 ended, or its host stopped answering), whatever the main thread
    is doing, even waiting inside a collective for a rank 0 that will never come.

    After rank 0 asked this worker to exit (`exiting`), its close is expected: the main thread
    gets EXIT_GRACE_S to tear its side of the group down and end the process with code 0.
    """
    try:
        wait([liveness])
    except OSError:
        pass  # the keepalive gave up on the connection: rank 0's host is unreachable
    if exiting.is_set():
        time.sleep(EXIT_GRACE_S)
        os._exit(0)
    logger.error(f"rank 0 closed its connection (it ended, or its host stopped answering): "
                 f"tensor-parallel rank {rank} exits")
    os._exit(1)
