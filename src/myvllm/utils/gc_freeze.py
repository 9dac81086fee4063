"""Keep Python's garbage collector from walking the engine in the middle of a run.

CPython's collector is generational: a full (generation-2) collection visits every object the
collector tracks. An engine holds hundreds of thousands of them for its whole life (the model's
modules and parameters, the block manager's ~70,000 blocks on an H200, the CUDA graphs'
bookkeeping): on the H200 machine one full collection in the middle of a bench run took
227-263 ms, 3.5% of that run (docs/benchmarks.md). None of those objects can become garbage
while the engine runs, so walking them finds nothing.

gc.freeze() moves every object that exists at that moment out of the collector's reach;
objects created later (requests, sequences, outputs) are collected as usual, and
gc.unfreeze() puts the frozen ones back afterwards. vLLM freezes its heap once start-up
is done (freeze_gc_heap in vllm/utils/gc_utils.py) for the same reason.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_depth = 0  # frozen_heap blocks currently open, in any thread


@contextmanager
def frozen_heap() -> Iterator[None]:
    """Inside: every object that exists on entry is out of the garbage collector's reach.

    Freezing and unfreezing move whole lists, O(1). Garbage that exists on entry is frozen
    with the rest and collected as usual after the exit (a gc.collect() on entry would cost a
    full collection, the very pause this avoids, on every call).

    CPython has one frozen generation, not a stack of them: the exit of the outermost open
    block unfreezes everything, also what the caller or a library froze before (this only
    makes those objects collectable again). Blocks may nest and may be open in several
    threads at once (generate() on one engine, the serving loop of another); an inner block
    freezes what was created since, and only the last one to close unfreezes.
    """
    global _depth
    with _lock:
        _depth += 1
        gc.freeze()
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                gc.unfreeze()
