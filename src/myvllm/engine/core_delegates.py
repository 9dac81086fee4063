"""The calls that pass straight on: LLMEngine's (llm_engine.py) to its EngineCore (core.py),
the scheduler and the model runner (for tests, examples and diagnostics), the engine's life
and the step as the core returns it; and EngineCore's to its Executor (executor/executor.py).
LLMEngine derives from CoreDelegates and EngineCore from ExecutorDelegates, so these stay
their methods.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from myvllm.engine.batch import RequestOutput

if TYPE_CHECKING:
    from myvllm.engine.core import EngineCore
    from myvllm.executor.executor import Executor


class ExecutorDelegates:
    executor: Executor

    @property
    def model_runner(self) -> Any:
        return self.executor.model_runner

    @property
    def dead_reason(self) -> str | None:
        return self.executor.dead_reason

    def check_alive(self) -> None:
        self.executor.check_alive()

    def shutdown(self) -> None:
        """Stop the worker processes and release the process group (idempotent)."""
        self.executor.shutdown()


class CoreDelegates:
    engine_core: EngineCore

    @property
    def scheduler(self) -> Any:
        return self.engine_core.scheduler

    @property
    def model_runner(self) -> Any:
        return self.engine_core.model_runner

    @property
    def dead_reason(self) -> str | None:
        """Why this engine can run no more steps (tensor parallelism: a worker died, a step
        failed, or exit() was called), or None."""
        return self.engine_core.dead_reason

    def check_alive(self) -> None:
        """Raise EngineDeadError if this engine can run no more steps (see dead_reason)."""
        self.engine_core.check_alive()

    def exit(self) -> None:
        """Stop the worker processes and release the process group (idempotent)."""
        self.engine_core.shutdown()

    def has_unfinished_requests(self) -> bool:
        return self.engine_core.has_unfinished_requests()

    def is_finished(self) -> bool:
        return not self.engine_core.has_unfinished_requests()

    def step_outputs(self) -> tuple[list[RequestOutput], int]:
        """One scheduler step, a RequestOutput per request that got tokens (for callers that
        stream): EngineCore.step."""
        return self.engine_core.step()
