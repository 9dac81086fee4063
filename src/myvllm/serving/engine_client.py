"""EngineClient: what the server and its routes need of an engine (vLLM's name for it).

Two classes have it: AsyncLLM (one engine core process) and DPAsyncLLM (several, one per
data-parallel replica, behind one router). The server is written against this, so it serves
either without knowing which.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable, Iterable
from typing import Any, Protocol

from myvllm.config import Config
from myvllm.serving.async_llm import StatLogger, StreamOutput
from myvllm.sampling_parameters import SamplingParams


class EngineClient(Protocol):
    tokenizer: Any  # None for a checkpoint without one (prompts are token ids)
    model_path: str
    config: Config  # the settings the engine resolved (KV blocks, max_model_length, ...)
    max_model_length: int
    vocab_size: int
    stat_logger: StatLogger

    @property
    def is_running(self) -> bool: ...

    def start(self) -> None: ...

    def on_core_death(self, callback: Callable[[BaseException], None]) -> None: ...

    def encode(self, prompt: str | list[int]) -> list[int]: ...

    def generate(self, prompt: str | list[int], sampling_params: SamplingParams,
                 request_id: str | None = None, stop: Iterable[str] = (),
                 streamed: bool = True) -> AsyncGenerator[StreamOutput, None]: ...

    def abort(self, request_id: str) -> None: ...

    def abort_all(self) -> None: ...

    def shutdown(self) -> None: ...
