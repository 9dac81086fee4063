"""FinishedOutputs: the dicts of finished requests that asked for logprobs or n > 1
completions, which need more than their last RequestOutput (engine/outputs.py says what a
dict holds). LLMEngine makes one at the first such request; until then a finished
RequestOutput makes its dict alone (engine/outputs.finished_dict).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from myvllm.engine.batch import RequestOutput
from myvllm.engine.outputs import finished_dict
from myvllm.engine.sequence import Sequence
from myvllm.sample.extras import LogprobsLists
from myvllm.sample.logprobs import LogprobsCollector


@dataclass
class _Completions:
    """A request of n > 1 completions: those finished so far."""

    outputs: list[dict[str, Any] | None]  # per completion, once finished
    first: dict[str, Any] | None = None  # completion 0's own dict: the request's fields


class FinishedOutputs:
    """What a request's dict needs beyond its last RequestOutput, gathered step by step: the
    logprobs of each completion that asked, and the finished completions of n > 1."""

    def __init__(self) -> None:
        # The completions that asked for logprobs, by (request id, completion index).
        self._logprobs: dict[tuple[int, int], LogprobsCollector] = {}
        # Requests of n > 1 completions: the finished ones' dicts, until all n are.
        self._completions: dict[int, _Completions] = {}

    def add(self, seq: Sequence) -> None:
        """A request queued as seq (its first completion)."""
        params = seq.sampling_params
        if params.logprobs is not None or params.prompt_logprobs is not None:
            for index in range(params.n):
                self._logprobs[seq.seq_id, index] = LogprobsCollector(
                    seq.prompt_token_ids,
                    None if params.logprobs is None else LogprobsLists([], [], []))
        if params.n > 1:
            self._completions[seq.seq_id] = _Completions([None] * params.n)

    def forget(self, request_id: int) -> None:
        """An aborted request."""
        for key in [key for key in self._logprobs if key[0] == request_id]:
            del self._logprobs[key]
        self._completions.pop(request_id, None)

    def collect(self, outputs: list[RequestOutput]) -> list[dict[str, Any]]:
        """One step's outputs in; the dicts of the requests that finished in it out."""
        finished = []
        for out in outputs:
            key = (out.request_id, out.index)
            collector = self._logprobs.get(key)
            if collector is not None:
                collector.add(out)
            if not out.finished:
                continue
            done = finished_dict(out)
            if collector is not None:
                done.update(self._logprobs.pop(key).result(out.token_ids))
            completions = self._completions.get(out.request_id)
            if completions is None:  # one completion
                finished.append(done)
                continue
            completions.outputs[out.index] = {"index": out.index, "token_ids": out.token_ids,
                                              "finish_reason": out.finish_reason,
                                              "logprobs": done["logprobs"]}
            if out.index == 0:
                completions.first = done
            if out.request_finished:
                del self._completions[out.request_id]
                assert completions.first is not None  # all n have finished, 0 too
                finished.append({**completions.first, "outputs": completions.outputs})
        return finished


def gathering(finished: FinishedOutputs | None, seq: Sequence) -> FinishedOutputs:
    """finished (made now if None: at an engine's first request with extras) gathering for
    seq, a request with extras, too."""
    if finished is None:
        finished = FinishedOutputs()
    finished.add(seq)
    return finished
