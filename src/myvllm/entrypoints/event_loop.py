"""The event loop the server runs on: uvloop where it can be imported, else asyncio's own.

Every server-sent event of a stream goes through the event loop several times (the reader's
wake-up, the stream's queue, the response's send, the socket write), so the loop's own cost
per callback is part of the front end's cost per event. uvloop (MagicStack) is a drop-in
asyncio loop written on libuv; vLLM's API server runs on it, and uvicorn picks it when
installed. It is not a dependency: on the 2-core CPU harness it showed no gain beyond the
run-to-run spread (docs/benchmarks.md). Without it (not installed; Windows has no build) the
server runs on asyncio's loop, with nothing else changed.
"""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import Callable

LoopFactory = Callable[[], asyncio.AbstractEventLoop]


def serving_loop_name() -> str:
    """"uvloop" where it can be imported, else "asyncio": uvicorn's names for its `loop`
    setting (uvicorn makes the loop; on Windows asyncio's is the one it picks there)."""
    try:
        importlib.import_module("uvloop")
    except ImportError:  # not installed (Windows has no build): asyncio's loop serves
        return "asyncio"
    return "uvloop"


def serving_loop_factory() -> LoopFactory:
    """A maker of the loop serving_loop_name names, for a server run by its caller's own
    loop (`await server.serve()`, as benchmarks/benchmark_frontend.py does)."""
    if serving_loop_name() == "uvloop":
        return importlib.import_module("uvloop").new_event_loop
    return asyncio.new_event_loop
