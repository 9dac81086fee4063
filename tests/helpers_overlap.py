"""Which steps of an engine overlapped: the order of its ModelRunner.run and
Scheduler.postprocess calls (async scheduling queues a step before the previous step's
tokens are read back)."""

from __future__ import annotations

from typing import Any

from myvllm import LLM


def record_overlap(llm: LLM) -> list[str]:
    """Log the order of ModelRunner.run and Scheduler.postprocess calls."""
    calls: list[str] = []
    run, postprocess = llm.model_runner.run, llm.scheduler.postprocess

    def logged_run(*args: Any) -> Any:
        calls.append("run")
        return run(*args)

    def logged_postprocess(*args: Any) -> Any:
        calls.append("post")
        return postprocess(*args)

    llm.model_runner.run = logged_run  # type: ignore[method-assign]
    llm.scheduler.postprocess = logged_postprocess  # type: ignore[method-assign]
    return calls


def overlapped(calls: list[str]) -> bool:
    """Was some step queued before the previous step's tokens were read?"""
    return any(a == b == "run" for a, b in zip(calls, calls[1:]))
