"""Ending a process of the engine's own (the engine core process, a tensor-parallel worker)
once its shutdown is done, without the interpreter's exit.

What that exit does has nothing left to do for anyone: it tears down every module (torch,
transformers, ...), torch deregisters its kernels, the atexit handlers run and the whole heap
is garbage-collected (perf on an exiting core process showed ~60% of it in the collector's
walk). On a 2-core CPU, tiny model, that took the core process 0.7-1 s, longer than the front
end's patience under load (SIGTERM, then SIGKILL), and rank 0's exit() waited 1.5-2.0 s for
its worker (TP 2, gloo, load ~3; 0.04-0.06 s with this exit). So both end with os._exit as
soon as their own shutdown has run (the core: loop left, sockets closed, workers stopped; a
worker: its side of the process group destroyed).

Only what a person or a log file still waits for is flushed first: every logging handler and
the buffered stdout/stderr. Nothing else is needed: these processes leave no other Python
buffer of theirs unwritten, and the kernel closes their pipes and sockets. Not for a process
that runs someone else's code after ours (a user's script under torchrun): its atexit
handlers and finally blocks are its own.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn


def exit_without_finalizing() -> NoReturn:
    """End this process with exit code 0 at once, its shutdown done: log handlers and
    stdout/stderr flushed, then os._exit, skipping the interpreter's own exit (the module
    docstring says why)."""
    logging.shutdown()  # flushes (and closes) every log handler
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(0)
