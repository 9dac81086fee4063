"""Requests held outside the scheduler until their grammar is compiled (the core process).

The engine core's loop takes a request with structured outputs, checks it (make_sequence
without its grammar) and holds it here while a compile thread builds its grammar; between
steps it asks which are ready and queues those, matcher set, and refuses those whose grammar
failed, or was not ready within its time limit (counted from when the request was held, the
wait for a compile thread included). The scheduler never sees a request waiting for its
grammar, and the other requests keep stepping meanwhile.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol

from myvllm.engine.sequence import Sequence
from myvllm.sampling_parameters import StructuredOutputsParams
from myvllm.structured_output.compile_threads import GrammarCompile
from myvllm.structured_output.matchers import set_matcher
from myvllm.structured_output.step_budget import GrammarStepBudget


class Compiles(Protocol):
    """What GrammarWaits asks of the StructuredOutputManager (manager.py, which makes it)."""

    step_budget: GrammarStepBudget

    def request(self, params: StructuredOutputsParams) -> GrammarCompile: ...

    def outcome(self, params: StructuredOutputsParams, job: GrammarCompile, since: float,
                now: float) -> Any: ...

    def release(self, params: StructuredOutputsParams, job: GrammarCompile) -> None: ...


@dataclass
class HeldRequest:
    seq: Sequence
    job: GrammarCompile
    since: float  # time.monotonic() when it was held: its time limit counts from here

    @property
    def params(self) -> StructuredOutputsParams:
        params = self.seq.sampling_params.structured_outputs
        assert params is not None, "only a request with structured outputs waits here"
        return params


class GrammarWaits:
    """The requests waiting for their grammars, by the caller's request id, oldest first."""

    def __init__(self, manager: Compiles) -> None:
        self.manager = manager
        self._held: dict[int, HeldRequest] = {}

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, request_id: int, seq: Sequence) -> None:
        """Start (or join) the compile of seq's grammar and hold seq until it is done.
        A grammar known to be too slow raises ValueError now."""
        since = time.monotonic()
        params = seq.sampling_params.structured_outputs
        assert params is not None, "only a request with structured outputs waits here"
        self._held[request_id] = HeldRequest(seq, self.manager.request(params), since)

    def drop(self, request_id: int) -> None:
        """Forget a held request (aborted), and its compile if no other request waits for
        it; unknown ids are ignored."""
        held = self._held.pop(request_id, None)
        if held is not None:
            self.manager.release(held.params, held.job)

    def take_ready(self) -> list[tuple[int, Sequence | ValueError]]:
        """The held requests whose grammar is done, oldest first, no longer held: each its
        Sequence with its matcher set, or the ValueError that refuses it."""
        now = time.monotonic()
        ready: list[tuple[int, Sequence | ValueError]] = []
        for request_id, held in list(self._held.items()):
            try:
                grammar = self.manager.outcome(held.params, held.job, held.since, now)
            except ValueError as e:
                ready.append((request_id, e))
                del self._held[request_id]
                continue
            if grammar is not None:
                set_matcher(held.seq, grammar, self.manager.step_budget)
                ready.append((request_id, held.seq))
                del self._held[request_id]
        return ready
