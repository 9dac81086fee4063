"""Errors that mean "this engine can run no more requests", as opposed to a bad request."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine cannot run steps any more: a tensor-parallel worker died, a tensor-parallel
    step failed, the engine was shut down, or (AsyncLLM) its engine loop stopped. Build a new
    engine; the server answers 503."""
