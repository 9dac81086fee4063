"""Grammars compiled in threads of their own, so that no step waits for one.

xgrammar's compiler releases the interpreter lock while it compiles (measured on a CPU: a
Python thread counting beside a 7 s compile of a 3,000-rule grammar kept its pace but for
what the two cores' other work took, its longest pause 16 ms, where a second Python thread
competing for the lock cut it to a quarter), so the engine's loop and its heartbeat go on
while a grammar compiles; the same loop waiting inside the compile would stop every request.

A compile no request waits for any more is abandoned (StructuredOutputManager.outcome): one
still queued is withdrawn and never runs; one running cannot be interrupted, so it runs on to
its end in its thread and its result is dropped. At most num_threads compiles run at once,
abandoned or not, so at most that many abandoned ones can pile up; the grammars queued behind
them wait, within their requests' time limit.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from myvllm.sampling_parameters import StructuredOutputsParams

logger = logging.getLogger("myvllm")


class GrammarCompile:
    """One grammar's compile: queued, running (started is set) or done (grammar or error)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind  # "json", "regex", ...: named in its errors
        self.started: float | None = None  # time.monotonic() when its compile began
        self.finished = threading.Event()
        self.grammar: Any = None  # the CompiledGrammar, once finished without error
        self.error: ValueError | None = None
        # The requests waiting for it (the manager's count, kept by the engine's thread):
        # when the last gives up, the compile is abandoned.
        self.waiters = 0

    @classmethod
    def done_with(cls, kind: str, grammar: Any) -> GrammarCompile:
        """A compile that is already done (a grammar from the cache)."""
        job = cls(kind)
        job.grammar = grammar
        job.waiters = 1  # the request it is made for
        job.finished.set()
        return job

    def running_for(self, now: float) -> float:
        """Seconds its compile has run so far (0 while queued or once finished)."""
        started = self.started
        return 0.0 if started is None or self.finished.is_set() else now - started


class CompileThreads:
    """num_threads daemon threads (started with the first job) that take jobs in order.

    Daemon threads: an abandoned compile must not keep the process from exiting."""

    def __init__(self, num_threads: int, prepare: Callable[[], object],
                 compile_grammar: Callable[[StructuredOutputsParams], Any]) -> None:
        """prepare: run before each compile and not timed (the compiler, made by the first:
        its pass over the vocabulary is not the grammar's doing)."""
        self._num_threads = num_threads
        self._prepare = prepare
        self._compile_grammar = compile_grammar
        self._queued: deque[tuple[GrammarCompile, StructuredOutputsParams]] = deque()
        self._changed = threading.Condition()  # guards _queued
        self._threads: list[threading.Thread] = []

    def __len__(self) -> int:
        """Jobs queued, not yet taken by a thread."""
        return len(self._queued)

    def submit(self, params: StructuredOutputsParams) -> GrammarCompile:
        job = GrammarCompile(params.key()[0])
        if not self._threads:
            self._threads = [threading.Thread(target=self._run, daemon=True,
                                              name=f"myvllm-grammar-{i}")
                             for i in range(self._num_threads)]
            for thread in self._threads:
                thread.start()
        with self._changed:
            self._queued.append((job, params))
            self._changed.notify()
        return job

    def withdraw(self, job: GrammarCompile) -> bool:
        """Take job out of the queue if no thread has taken it yet (then it never runs);
        False if one has (a compile cannot be interrupted)."""
        with self._changed:
            for i, (queued, _) in enumerate(self._queued):
                if queued is job:
                    del self._queued[i]
                    return True
        return False

    def _take(self) -> tuple[GrammarCompile, StructuredOutputsParams]:
        with self._changed:
            while not self._queued:
                self._changed.wait()
            return self._queued.popleft()

    def _run(self) -> None:
        while True:
            job, params = self._take()
            try:
                self._prepare()
                job.started = time.monotonic()
                job.grammar = self._compile_grammar(params)
            except ValueError as e:  # the request's spec: its refusal says why
                job.error = e
            except RecursionError:
                job.error = ValueError(f"StructuredOutputsParams.{job.kind} is nested too "
                                       "deeply to compile")
            except Exception as e:  # anything else: the request is refused, and it is logged
                logger.exception(f"compiling a {job.kind} grammar failed")
                job.error = ValueError(f"StructuredOutputsParams.{job.kind} cannot be "
                                       f"compiled: {type(e).__name__}: {e}")
            finally:
                job.finished.set()
