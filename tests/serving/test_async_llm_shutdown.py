"""AsyncLLM.shutdown(): the Shutdown message alone ends the engine core process, with exit
code 0, idle or with a stream in flight; SIGTERM and SIGKILL are for a core that does not
read it (a step in progress, a hang: test_server_dead_engine.py, test_server_soak.py).

The core used to finish its shutdown and then spend its grace period in the interpreter's own
exit (tearing down torch and garbage-collecting the heap), so on a busy CPU the front end sent
SIGTERM, then SIGKILL, to a core that had nothing left to do. Whether it escalated is read
from what it logs, not from the time shutdown() took.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator

import pytest

from helpers_models import tiny_checkpoint
from myvllm import Config, SamplingParams
from myvllm.serving.async_llm import AsyncLLM

READY_TIMEOUT_S = 120.0  # the first output, on a loaded 2-core machine


class Records(logging.Handler):
    """What the library logs (its logger does not propagate to pytest's caplog)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def warnings_logged() -> Iterator[list[str]]:
    records = Records()
    logger = logging.getLogger("myvllm")
    logger.addHandler(records)
    try:
        yield records.messages
    finally:
        logger.removeHandler(records)


def start_engine() -> AsyncLLM:
    return AsyncLLM(Config(model=str(tiny_checkpoint("qwen3")), num_kvcache_blocks=64,
                           max_model_length=256))


def assert_ended_by_itself(llm: AsyncLLM, warnings: list[str]) -> None:
    assert not llm._process.is_alive()
    escalations = [m for m in warnings if "SIGTERM" in m or "SIGKILL" in m]
    assert escalations == [], "the core did not leave on Shutdown alone"
    assert llm._process.exitcode == 0


@pytest.mark.parametrize("in_flight", [False, True], ids=["idle", "mid_stream"])
def test_shutdown_ends_the_core_without_sigterm(warnings_logged: list[str],
                                                in_flight: bool) -> None:
    """Idle (a request answered), or with a long stream decoding: the core reads Shutdown
    between steps, aborts what runs, and its process exits 0 by itself."""
    llm = start_engine()
    loop = asyncio.new_event_loop()  # not closed before shutdown(), as the chat's between turns
    first_output = asyncio.Event()

    async def stream(max_tokens: int) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        async for _ in llm.generate("hello", params):
            first_output.set()

    try:
        if in_flight:
            async def until_streaming() -> asyncio.Task[None]:
                task = asyncio.get_running_loop().create_task(stream(200))
                await asyncio.wait_for(first_output.wait(), READY_TIMEOUT_S)
                return task

            streaming = loop.run_until_complete(until_streaming())
            assert llm._by_request_id  # still decoding when the shutdown comes
        else:
            loop.run_until_complete(asyncio.wait_for(stream(4), READY_TIMEOUT_S))
        llm.shutdown()
        assert_ended_by_itself(llm, warnings_logged)
        if in_flight:  # its stream ended with the abort
            loop.run_until_complete(asyncio.wait_for(streaming, READY_TIMEOUT_S))
    finally:
        llm.shutdown()
        loop.close()
