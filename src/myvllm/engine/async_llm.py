"""AsyncLLM: the engine as a stream of tokens, for callers living in an asyncio event loop.

    llm = AsyncLLM(LLMEngine(config))
    async for out in llm.generate(prompt, SamplingParams(max_tokens=64), "req-1"):
        print(out.text, end="")                 # the new text of this step
    llm.abort("req-1")                          # from anywhere in the loop: frees its blocks
    llm.shutdown()

Where the engine loop runs. LLMEngine.step() blocks for a whole forward pass, so it cannot run
on the event loop: the HTTP server would stop answering for the length of every step. The loop
runs in ONE background thread of the same process, beside the asyncio event loop:

    event loop thread (HTTP, tokenizing,         engine thread (owns the LLMEngine)
    detokenizing, one coroutine per request)
      generate(): encode, queue "add" ------------> add_request()            commands
                                                    step_outputs()  <- one forward pass
      _deliver(): token ids to each request <------ call_soon_threadsafe(outputs of the step)
      detokenize, stop strings, yield text
      client gone / stop string: queue "abort" ---> abort(): blocks freed at once

Only the engine thread touches the engine (scheduler, block manager, model runner), so the
engine needs no locks; only the event loop thread touches the tokenizer and the per-request
state. They talk through a command queue one way and call_soon_threadsafe the other way.

Why a thread and not a process: one process is the simplest design to read and debug, and it
costs little here because the forward pass runs in torch and Triton, which release the GIL
while the GPU (or the CPU kernels) work. Tokenizing, detokenizing and the HTTP code still share
the GIL with the engine's Python code (scheduling, input building), which caps throughput at
high request rates. vLLM therefore runs its engine loop in a separate process (EngineCore) and
ships token ids over ZeroMQ, so the API server's Python never delays a step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterable
from typing import TYPE_CHECKING, Any

import torch

from myvllm.engine.detokenizer import IncrementalDetokenizer
from myvllm.engine.errors import EngineDeadError
from myvllm.sampling_parameters import SamplingParams
from myvllm.utils.gc_freeze import frozen_heap

if TYPE_CHECKING:
    from myvllm.engine.batch import RequestOutput
    from myvllm.engine.llm_engine import LLMEngine

logger = logging.getLogger("myvllm")

__all__ = ["AsyncLLM", "EngineDeadError", "StatLogger", "StreamOutput"]


@dataclasses.dataclass
class StreamOutput:
    """What generate() yields: one request's news from one engine step."""

    request_id: str
    text: str | None  # new text (None for a model without a tokenizer)
    token_ids: list[int]  # new token ids
    finished: bool
    finish_reason: str | None  # "stop" (eos or a stop string), "length", "abort"
    num_prompt_tokens: int
    num_completion_tokens: int  # so far; tokens after a stop string are not counted
    num_cached_tokens: int  # prompt tokens whose K/V came from the prefix cache


class StatLogger:
    """Hooks the engine loop and the request streams call; the default records nothing.

    record_scheduler runs on the engine thread after every step; the others run on the
    event loop thread. Times are time.monotonic() seconds.
    """

    def record_scheduler(self, num_running: int, num_waiting: int,
                         kv_cache_usage: float) -> None:
        pass

    def record_first_token(self, time_to_first_token: float, num_prompt_tokens: int,
                           num_cached_tokens: int) -> None:
        pass

    def record_tokens(self, num_tokens: int, inter_token_latency: float | None) -> None:
        pass

    def record_finished(self, finish_reason: str, e2e_latency: float) -> None:
        pass


@dataclasses.dataclass
class _Stream:
    """Per-request state on the event loop side."""

    request_id: str
    queue: asyncio.Queue[Any]  # RequestOutput items, _ABORTED, or an exception
    added: asyncio.Future[int]  # the engine's request id, or the engine's refusal
    engine_id: int = -1


@dataclasses.dataclass
class _Add:
    token_ids: list[int]
    params: SamplingParams
    stream: _Stream
    streamed: bool  # someone reads the tokens as they come (Sequence.streamed)


# While idle, the engine thread wakes this often to see whether the engine died meanwhile
# (a tensor-parallel worker killed between requests), so it stops and frees it at once.
IDLE_CHECK_S = 1.0

_ABORTED = object()  # put in a stream's queue: the request was aborted on our side
_STOP = object()  # put in the command queue: the engine thread aborts everything and ends


class AsyncLLM:
    def __init__(self, engine: LLMEngine, stat_logger: StatLogger | None = None) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.stat_logger = stat_logger or StatLogger()
        self._commands: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        # Event loop thread only:
        self._streams: dict[int, _Stream] = {}  # by engine request id
        self._by_request_id: dict[str, _Stream] = {}
        self._closing = False
        self.dead_error: BaseException | None = None  # why the engine loop stopped, if it did

    # ------------------------------------------------------------------ lifecycle
    def _start(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
            self._thread = threading.Thread(target=self._run, name="myvllm-engine", daemon=True)
            self._thread.start()
        elif self._loop is not loop:
            raise RuntimeError("AsyncLLM is bound to the event loop it first ran in")

    @property
    def is_running(self) -> bool:
        """True while requests are accepted: not shut down, engine loop alive, and the engine
        itself able to run (a dead tensor-parallel worker stops it even while idle)."""
        return (not self._closing and self.dead_error is None
                and self.engine.dead_reason is None)

    def abort_all(self) -> None:
        """Stop accepting requests and abort every request in flight (safe from a signal
        handler on the event loop thread: it only queues work)."""
        self._closing = True
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._abort_streams)
        self._commands.put(_STOP)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Abort everything, end the engine thread, stop tensor-parallel workers; idempotent.
        Call it from outside the engine thread, after the event loop stopped serving."""
        self._closing = True
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._abort_streams)
        self._commands.put(_STOP)
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                logger.warning(f"the engine thread did not stop within {timeout_s} s")
        self.engine.exit()

    # ------------------------------------------------------------------ requests
    def encode(self, prompt: str | list[int]) -> list[int]:
        """The prompt's token ids (a str is tokenized as LLMEngine.add_request does)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompts as token ids")
            return list(self.tokenizer.encode(prompt))
        return list(prompt)

    async def generate(self, prompt: str | list[int], sampling_params: SamplingParams,
                       request_id: str | None = None, stop: Iterable[str] = (),
                       streamed: bool = True) -> AsyncIterator[StreamOutput]:
        """Queue one request and yield its outputs as the engine produces them.

        streamed=False: the caller only wants the whole answer (a non-streaming HTTP request),
        so the engine need not keep the steps this request decodes in short.

        Bad input (the engine's ValueError / TypeError) raises before the first output.
        Leaving the loop early (a client that went away, a cancelled task) aborts the request.
        """
        self._start()
        if not self.is_running:
            why = self.engine.dead_reason or (f"its loop failed: {self.dead_error!r}"
                                              if self.dead_error else "it is shutting down")
            raise EngineDeadError(f"the engine cannot take requests: {why}"
                                  ) from self.dead_error
        request_id = request_id if request_id is not None else uuid.uuid4().hex
        if request_id in self._by_request_id:
            raise ValueError(f"request id {request_id!r} is already running")
        arrival = time.monotonic()
        token_ids = self.encode(prompt)
        stop = list(stop)
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(self.tokenizer, token_ids, stop)
        elif stop:
            raise ValueError("stop strings need a tokenizer; this model has none")

        assert self._loop is not None
        added: asyncio.Future[int] = self._loop.create_future()
        stream = _Stream(request_id, asyncio.Queue(), added)
        self._by_request_id[request_id] = stream
        engine_finished = False
        try:
            self._commands.put(_Add(token_ids, sampling_params, stream, streamed))
            await added  # the engine's validation error, if any, is raised here
            last_time = None
            num_tokens = 0
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise EngineDeadError(f"the engine loop failed: {item!r}") from item
                now = time.monotonic()
                if item is _ABORTED:  # the engine learns it in `finally`
                    self.stat_logger.record_finished("abort", now - arrival)
                    yield StreamOutput(request_id, "" if detok else None, [], True, "abort",
                                       len(token_ids), num_tokens, 0)
                    return
                out: RequestOutput = item
                if last_time is None:
                    self.stat_logger.record_first_token(now - arrival, out.num_prompt_tokens,
                                                        out.num_cached_tokens)
                new_ids = out.new_token_ids
                text: str | None = None
                if detok is not None:
                    text = detok.add_tokens(new_ids)
                    new_ids = new_ids[:max(0, detok.num_tokens - num_tokens)]
                    if out.finished or detok.stopped:
                        text += detok.finish()
                if new_ids:
                    self.stat_logger.record_tokens(
                        len(new_ids), None if last_time is None else now - last_time)
                num_tokens += len(new_ids)
                last_time = now
                engine_finished = out.finished
                stopped = detok is not None and detok.stopped
                finished = out.finished or stopped
                reason = "stop" if stopped else out.finish_reason
                if finished:
                    self.stat_logger.record_finished(reason or "stop", now - arrival)
                yield StreamOutput(request_id, text, new_ids, finished,
                                   reason if finished else None, out.num_prompt_tokens,
                                   num_tokens, out.num_cached_tokens)
                if finished:
                    return
        finally:
            del self._by_request_id[request_id]
            if not engine_finished:
                if added.done() and not added.cancelled() and added.exception() is None:
                    self._abort_engine(added.result())
                else:
                    added.cancel()  # _resolve_add aborts it if it gets added after all

    def abort(self, request_id: str) -> None:
        """Abort a request by the id given to generate(): its stream ends with finish_reason
        "abort" and its blocks are freed. Unknown or finished ids are ignored."""
        stream = self._by_request_id.get(request_id)
        if stream is None:
            return
        stream.queue.put_nowait(_ABORTED)
        if stream.engine_id >= 0:  # else generate() aborts it once the engine has added it
            self._abort_engine(stream.engine_id)

    def _abort_engine(self, engine_id: int) -> None:
        self._streams.pop(engine_id, None)
        self._commands.put(("abort", engine_id))

    def _abort_streams(self) -> None:
        for stream in list(self._by_request_id.values()):
            if not stream.added.done():  # its "add" may never be read by the engine thread
                stream.added.set_exception(EngineDeadError("the engine is shutting down"))
            stream.queue.put_nowait(_ABORTED)

    # ------------------------------------------------------------------ engine thread -> loop
    def _resolve_add(self, command: _Add, engine_id: int | None,
                     error: BaseException | None) -> None:
        """On the event loop: the engine thread has added (or refused) a request."""
        added = command.stream.added
        if added.done():  # cancelled (nobody listens any more) or failed by a shutdown
            if engine_id is not None:
                self._commands.put(("abort", engine_id))
            return
        if error is not None:
            added.set_exception(error)
            return
        assert engine_id is not None
        # Registered here, not after `await added`: the outputs of the next step may be
        # delivered before the waiting coroutine resumes.
        command.stream.engine_id = engine_id
        self._streams[engine_id] = command.stream
        added.set_result(engine_id)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """On the event loop: hand one step's outputs to their streams."""
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # aborted meanwhile
            stream.queue.put_nowait(out)
            if out.finished:
                del self._streams[out.request_id]

    def _fail(self, error: BaseException) -> None:
        """On the event loop: the engine loop died; every request ends with the error."""
        self.dead_error = error
        for stream in self._by_request_id.values():
            if not stream.added.done():
                stream.added.set_exception(EngineDeadError(f"the engine loop failed: {error!r}"))
            stream.queue.put_nowait(error)
        self._streams.clear()

    def _post(self, callback: Any, *args: Any) -> None:
        assert self._loop is not None
        if self._loop.is_closed():
            logger.debug("event loop closed: engine output dropped")
            return
        self._loop.call_soon_threadsafe(callback, *args)

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        engine = self.engine
        device = engine.model_runner.device
        if device.type == "cuda":
            torch.cuda.set_device(device)  # CUDA's current device is per host thread
        try:
            # The engine lives as long as this loop: no full garbage collection walks it.
            with frozen_heap():
                while True:
                    # Block for a command only when there is nothing to step.
                    commands = []
                    if not engine.has_unfinished_requests():
                        try:
                            commands.append(self._commands.get(timeout=IDLE_CHECK_S))
                        except queue.Empty:
                            engine.check_alive()  # raises once the engine died while idle
                            continue
                    while True:
                        try:
                            commands.append(self._commands.get_nowait())
                        except queue.Empty:
                            break
                    if any(c is _STOP for c in commands):
                        break
                    for command in commands:
                        self._apply(command)
                    if engine.has_unfinished_requests():
                        outputs, _ = engine.step_outputs()
                        if outputs:
                            self._post(self._deliver, outputs)
                    self._record_scheduler()
        except BaseException as e:  # reported to every waiting request, then logged
            logger.exception("the engine loop failed")
            self._post(self._fail, e)
            return
        self._abort_everything()

    def _apply(self, command: Any) -> None:
        if isinstance(command, _Add):
            try:
                engine_id = self.engine.add_request(command.token_ids, command.params,
                                                    streamed=command.streamed)
            except (ValueError, TypeError) as e:  # bad input: that request's error only
                self._post(self._resolve_add, command, None, e)
            else:
                self._post(self._resolve_add, command, engine_id, None)
        else:
            _, engine_id = command
            self.engine.abort(engine_id)

    def _abort_everything(self) -> None:
        """Shutdown: drop every request the engine still holds, so its blocks are free."""
        scheduler = self.engine.scheduler
        for seq in [*scheduler.running, *scheduler.waiting]:
            self.engine.abort(seq.seq_id)
        self._record_scheduler()

    def _record_scheduler(self) -> None:
        scheduler = self.engine.scheduler
        blocks = scheduler.block_manager
        usage = 1.0 - len(blocks.free_block_ids) / len(blocks.blocks)
        self.stat_logger.record_scheduler(len(scheduler.running), len(scheduler.waiting), usage)
