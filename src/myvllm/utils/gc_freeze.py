"""Keep Python's garbage collector from walking the engine in the middle of a run.

CPython's collector is generational: a full (generation-2) collection visits every object the
collector tracks. An engine holds hundreds of thousands of them for its whole life (the model's
modules and parameters, the block manager's ~70,000 blocks on an H200, the CUDA graphs'
bookkeeping): on the H200 machine one full collection in the middle of a bench run took
263 ms, 3.5% of that run (docs/benchmarks.md). None of those objects can become garbage while
the engine runs, so walking them finds nothing.

gc.freeze() moves every object that exists at that moment out of the collector's reach;
objects created later (requests, sequences, outputs) are collected as usual, and
gc.unfreeze() puts the frozen ones back afterwards. vLLM and SGLang freeze the heap after
start-up for the same reason.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def frozen_heap() -> Iterator[None]:
    """Inside: what exists on entry is frozen out of garbage collection; restored on exit.

    If something has frozen objects already (the caller, or an outer frozen_heap), this
    leaves that choice alone: it freezes nothing and unfreezes nothing.
    """
    if gc.get_freeze_count():
        yield
        return
    # Freezing and unfreezing move whole lists: O(1). Garbage that exists on entry is frozen
    # with the rest and collected as usual after the exit (a gc.collect() here would cost a
    # full collection, the very pause this avoids, on every call).
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
