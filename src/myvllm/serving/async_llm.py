"""AsyncLLM: the engine as a stream of tokens, for callers living in an asyncio event loop.

    llm = AsyncLLM(Config(model=...))            starts the engine core process, waits for it
    async for out in llm.generate(prompt, SamplingParams(max_tokens=64), "req-1"):
        print(out.text, end="")                  the new text since the last output
    llm.abort("req-1")                           from anywhere in the loop: frees its blocks
    llm.shutdown()                               the core process and its workers end

This is the front end: tokenizing, incremental detokenizing, stop strings and per-request
streams live here; the EngineCore (scheduler, model runner, workers) runs in a child process
(core_process.py). They talk over two ZeroMQ sockets, in MessagePack (core_messages.py):

    event loop (this process)                       core process
      generate(): encode, AddRequest  ------------>  add_request()
                                                     step(), step(), ...
      _read_outputs(): one CoreOutputs per step <--  the new token ids of every request
        each request's new ids appended to its
        stream, and its coroutine woken
      generate(): detokenize, stop strings, yield
      client gone / stop string: AbortRequests --->  abort(): blocks freed at once

A request whose coroutine is slower than the engine (a busy HTTP process) finds the tokens of
several steps waiting when it wakes, and handles them as one output: the front end falls
behind by steps, never by messages, and the engine never waits for it.

If the core process dies, every request in flight ends with EngineDeadError, is_running turns
False, and the callbacks given to on_core_death run (the server exits, so that whoever
supervises it starts a new one). The same happens when the core stops answering while its
process lives (stopped, or stuck): it sends a heartbeat every second from a thread of its own,
and nothing at all for hang_timeout_s is taken for a hang (_watch_core).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import multiprocessing as mp
import os
import shutil
import signal
import tempfile
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Iterable, Iterator, Mapping
from multiprocessing.connection import wait
from typing import Any, cast

import msgspec
import zmq
import zmq.asyncio

from myvllm.config import Config
from myvllm.serving.core_messages import (AbortCompletion, AbortRequests, AddRequest, CoreDead,
                                         CoreMessage, CoreOutput, CoreOutputs, Heartbeat,
                                         Shutdown, SpecDecodeCounts)
from myvllm.serving.core_process import run_engine_core
from myvllm.serving.detokenizer import IncrementalDetokenizer
from myvllm.sample.extras import LogprobsLists
from myvllm.executor.errors import EngineDeadError
from myvllm.engine.request_checks import check_fits_context, check_token_ids
from myvllm.sample.sampling_controls import check_sampling_token_ids
from myvllm.engine.startup import ResolvedEngine, resolve_engine
from myvllm.sampling_parameters import SamplingParams
from myvllm.utils.hf_config import gguf_parsed_once
from myvllm.value_checks import refusal

logger = logging.getLogger("myvllm")

__all__ = ["AsyncLLM", "EngineDeadError", "StatLogger", "StreamOutput"]

START_TIMEOUT_S = 900.0  # loading a large checkpoint and capturing graphs takes minutes
CONNECT_TIMEOUT_S = 30.0  # from the core's "ready" to its sockets being connected (local ipc)
# Stopping the core (shutdown()): Shutdown, then SIGTERM, then SIGKILL. A core between steps
# reads Shutdown at once; a step on a GPU takes well under a second (a 30k-token prefill on an
# H200: 0.28 s), and stopping the tensor-parallel workers about as long. A step on a CPU can
# take minutes, and its answers go nowhere after a requested shutdown: not worth waiting for.
SHUTDOWN_WAIT_S = 2.0
# After SIGTERM: the core's handler runs after the torch op in progress, and exits at once.
TERMINATE_WAIT_S = 1.0
# Nothing from the core (not even its heartbeat, sent every second) for this long: it hangs.
# Ten beats missed: no scheduling hiccup of a busy machine, and no step, however long, is
# silent (the beat comes from a thread of its own); a stopped process or one stuck in C code
# holding the interpreter is.
HANG_TIMEOUT_S = 10.0
HANG_CHECK_S = 1.0  # how often the front end looks
# A step running this long is logged (and again every as long): the heartbeat goes on during a
# step, so a kernel that never returns would otherwise show only as requests that never end.
LONG_STEP_LOG_S = 60.0
# The most messages of the core the reader takes before the streams' turn: a few steps'
# (each step sends one or two), so that a reader behind the core catches up in a turn or two.
MAX_MESSAGES_PER_TURN = 16


@dataclasses.dataclass
class StreamOutput:
    """What generate() yields: one request's news since its last output."""

    request_id: str
    text: str | None  # new text (None for a model without a tokenizer)
    token_ids: list[int]  # new token ids
    finished: bool
    # "stop" (eos or a stop string), "length", "abort", "grammar_too_slow" (its grammar's
    # matcher ended by the step's grammar budget: structured_output/step_budget.py)
    finish_reason: str | None
    num_prompt_tokens: int
    num_completion_tokens: int  # so far; tokens after a stop string are not counted
    num_cached_tokens: int  # prompt tokens whose K/V came from the prefix cache
    # SamplingParams.logprobs: one entry per token of token_ids; None when not asked.
    logprobs: LogprobsLists | None = None
    # SamplingParams.prompt_logprobs: prompt tokens 1, 2, ..., in the first output only (of
    # each completion).
    prompt_logprobs: LogprobsLists | None = None
    # SamplingParams.n > 1: which completion this output is of; text, token_ids, finished,
    # finish_reason, num_completion_tokens and logprobs are that completion's.
    index: int = 0


class StatLogger:
    """Hooks the front end calls; the default records nothing. record_scheduler runs when a
    message of the core reports its queues; the others as requests stream. Times are
    time.monotonic() seconds."""

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

    def record_spec_decode(self, counts: SpecDecodeCounts) -> None:
        """Speculative decoding's totals since the core started (with each report of the
        queues, when it is on)."""


@dataclasses.dataclass
class _Completion:
    """One completion of a request: what the core sent that generate() has not taken yet
    (several steps' tokens when generate() is slow)."""

    new_token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: LogprobsLists | None = None  # of new_token_ids, when the request asked
    prompt_logprobs: LogprobsLists | None = None
    finish_reason: str | None = None  # set when the core says the completion finished
    # The core says no more of it: it finished, or generate() aborted it (a stop string).
    done: bool = False


@dataclasses.dataclass
class _Stream:
    """One request on the front end's side: its completions' news (one, unless
    SamplingParams.n > 1), and an event to wake generate()."""

    request_id: str
    core_id: int
    completions: list[_Completion]
    wake: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    aborted: bool = False  # abort() or shutdown on our side
    error: BaseException | None = None  # the core's refusal, or the engine's death

    def push(self, out: CoreOutput) -> None:
        completion = self.completions[out.index]
        if completion.done:
            return  # aborted by generate() meanwhile
        completion.new_token_ids += out.new_token_ids
        if out.logprobs is not None:
            if completion.logprobs is None:
                completion.logprobs = out.logprobs
            else:
                completion.logprobs.extend(out.logprobs)
        if out.prompt_logprobs is not None:  # sent once, with the first completion's output
            for each in self.completions:
                each.prompt_logprobs = out.prompt_logprobs
        completion.finish_reason = out.finish_reason
        completion.done = out.finish_reason is not None
        self.num_prompt_tokens = out.num_prompt_tokens
        self.num_cached_tokens = out.num_cached_tokens
        self.wake.set()

    @property
    def done(self) -> bool:
        """Nothing more to come from the core."""
        return all(c.done for c in self.completions)

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.wake.set()


@contextlib.contextmanager
def _environ(variables: Mapping[str, str]) -> Iterator[None]:
    """os.environ with variables set, restored afterwards."""
    saved = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class AsyncLLM:
    def __init__(self, config: Config, stat_logger: StatLogger | None = None,
                 hang_timeout_s: float | None = HANG_TIMEOUT_S, *,
                 resolved: ResolvedEngine | None = None,
                 core_environ: Mapping[str, str] | None = None,
                 wait_until_ready: bool = True) -> None:
        """Resolve the model here, start the core process, and return once it is ready
        (bad settings, a missing checkpoint or a failed start raise from here).
        hang_timeout_s: nothing heard from the core for this long fails every request and
        counts as the core's death (None: never).

        For DPAsyncLLM, which runs several of these, one per replica: resolved, the engine
        it resolved once for all of them; core_environ, variables set for the core process
        (CUDA_VISIBLE_DEVICES: the replica's GPUs); wait_until_ready False returns once the
        core process is started, so that every replica loads at the same time, and
        wait_until_ready() then finishes the start."""
        if config.data_parallel_size != 1:
            raise refusal("AsyncLLM: Config.data_parallel_size", config.data_parallel_size,
                          "1 (AsyncLLM runs one engine core; more replicas are DPAsyncLLM's: "
                          "myvllm.serving.dp_async_llm, which `myvllm serve` picks)")
        if resolved is None:
            with gguf_parsed_once():
                resolved = resolve_engine(config)
        self.tokenizer = resolved.tokenizer
        self.model_path = resolved.model_path
        self.stat_logger = stat_logger or StatLogger()
        self._ipc_dir = tempfile.mkdtemp(prefix="myvllm-core-")
        input_address = f"ipc://{self._ipc_dir}/input"
        output_address = f"ipc://{self._ipc_dir}/output"
        self._sync_context: zmq.Context[Any] = zmq.Context()
        self._input = self._sync_context.socket(zmq.PUSH)
        self._input.setsockopt(zmq.SNDHWM, 0)  # no limit on queued requests (see _send)
        self._input.setsockopt(zmq.LINGER, 0)  # closing never waits for a core that is gone
        self._input.bind(input_address)
        self._context = zmq.asyncio.Context()
        self._output = self._context.socket(zmq.PULL)
        self._output.setsockopt(zmq.RCVHWM, 0)
        self._output.setsockopt(zmq.LINGER, 0)
        self._output.bind(output_address)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(CoreMessage)

        self._loop: asyncio.AbstractEventLoop | None = None
        self._reader: asyncio.Task[None] | None = None
        self._watchdog: asyncio.Task[None] | None = None
        self.hang_timeout_s = hang_timeout_s
        self._last_heard = time.monotonic()  # when the core's last message arrived
        self._long_step_logged = 0.0  # the step length last logged (LONG_STEP_LOG_S)
        self._next_id = itertools.count()
        self._streams: dict[int, _Stream] = {}  # by core id
        self._by_request_id: dict[str, _Stream] = {}
        self._closing = False
        self._ready = False  # the core said "ready" and its sockets are connected
        self._shutdown_requested = False
        self._shutdown_began = 0.0  # when begin_shutdown() ran (time.monotonic())
        self._stopped = False  # shutdown() has ended the core and closed the sockets
        self.dead_error: BaseException | None = None  # why the core stopped, if it did
        self._death_callbacks: list[Callable[[BaseException], None]] = []

        ctx = mp.get_context("spawn")
        ready_receiver, ready_sender = ctx.Pipe(duplex=False)
        self._ready_receiver = ready_receiver
        self._process = ctx.Process(
            target=run_engine_core, name="myvllm-engine-core",
            args=(resolved.config, resolved.model_path, resolved.fit_length_to_cache,
                  input_address, output_address, ready_sender, os.getpid()))
        with _environ(core_environ or {}):  # a spawned child copies ours as it starts
            self._process.start()
        ready_sender.close()
        if wait_until_ready:
            self.wait_until_ready()

    def wait_until_ready(self) -> None:
        """Wait for the core started by __init__ to say "ready" (done by __init__ unless it
        was told not to); a failed start shuts it down and raises."""
        try:
            settings = self._wait_until_ready(self._ready_receiver)
        except BaseException:
            self.shutdown()
            raise
        self._ready = True
        self.config: Config = settings["config"]
        self.max_model_length: int = settings["max_model_length"]
        self.vocab_size: int = settings["vocab_size"]
        logger.info(f"engine core ready in process {self._process.pid}")

    def _wait_until_ready(self, ready: Any) -> dict[str, Any]:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not ready.poll(0):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the engine core did not start within {START_TIMEOUT_S} s")
            wait([ready, self._process.sentinel], timeout=1.0)
            if not self._process.is_alive() and not ready.poll(0):
                raise RuntimeError("the engine core process ended during start-up "
                                   f"({_describe_exit(self._process.exitcode)})")
        try:
            kind, detail = ready.recv()
        except EOFError:
            self._process.join(5)
            raise RuntimeError("the engine core process ended during start-up "
                               f"({_describe_exit(self._process.exitcode)})") from None
        ready.close()
        if kind == "error":
            raise RuntimeError(f"the engine core failed to start:\n{detail}")
        # The core connected its sockets before it said "ready"; ZeroMQ completes the
        # connection in the background, so wait until the input socket can take a message.
        if not self._input.poll(int(CONNECT_TIMEOUT_S * 1000), zmq.POLLOUT):
            raise RuntimeError("the engine core started but did not connect to its input "
                               f"socket within {CONNECT_TIMEOUT_S} s")
        settings: dict[str, Any] = detail
        return settings

    # ------------------------------------------------------------------ lifecycle
    @property
    def core_pid(self) -> int | None:
        return self._process.pid

    def start(self) -> None:
        """Bind to the running event loop: read the core's outputs and watch its process
        (done by the first generate() too; a server calls it at start-up, so that a core
        that dies before any request is noticed)."""
        loop = asyncio.get_running_loop()
        if self._loop is not None:
            if self._loop is not loop:
                raise RuntimeError("AsyncLLM is bound to the event loop it first ran in")
            return
        self._loop = loop
        self._reader = loop.create_task(self._read_outputs(), name="myvllm-core-outputs")
        self._last_heard = time.monotonic()
        if self.hang_timeout_s is not None:
            self._watchdog = loop.create_task(self._watch_core(self.hang_timeout_s),
                                              name="myvllm-core-watchdog")
        loop.add_reader(self._process.sentinel, self._on_core_exit)

    def on_core_death(self, callback: Callable[[BaseException], None]) -> None:
        """Call callback(error) on the event loop if the core process dies unasked, or
        stops answering."""
        self._death_callbacks.append(callback)

    @property
    def is_running(self) -> bool:
        """True while requests are accepted: not shut down and the core process alive."""
        return (not self._closing and self.dead_error is None
                and self._process.is_alive())

    def abort_all(self) -> None:
        """Stop accepting requests and abort every request in flight (safe from a signal
        handler on the event loop thread: it only queues work)."""
        self._closing = True
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._abort_streams)

    def _on_loop(self, callback: Callable[[], object]) -> None:
        """Run callback on the event loop: queued if the loop runs (shutdown may come from
        another thread), at once if it does not."""
        assert self._loop is not None
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(callback)
        else:
            callback()

    def begin_shutdown(self) -> None:
        """shutdown()'s first half, which does not wait: abort everything and tell the core
        to stop (DPAsyncLLM tells every replica before it waits for any); idempotent."""
        self._closing = True
        if self._shutdown_requested:
            return
        self._shutdown_requested = True
        self._shutdown_began = time.monotonic()
        loop = self._loop if self._loop is not None and not self._loop.is_closed() else None
        if loop is not None:
            self._on_loop(self._abort_streams)
            self._on_loop(lambda: loop.remove_reader(self._process.sentinel))
        if self._process.is_alive() and self._ready:
            self._send(Shutdown())

    def shutdown(self, timeout_s: float = SHUTDOWN_WAIT_S) -> None:
        """Abort everything and end the core process (and with it any tensor-parallel
        workers) within about timeout_s + TERMINATE_WAIT_S of begin_shutdown(), whatever it
        is doing; idempotent. Call it after the event loop stopped serving."""
        self.begin_shutdown()
        if self._stopped:
            return
        self._stopped = True
        loop = self._loop if self._loop is not None and not self._loop.is_closed() else None
        if self._process.is_alive() and self._ready:
            self._process.join(max(0.0, self._shutdown_began + timeout_s - time.monotonic()))
        if self._process.is_alive():
            if self._ready:
                logger.warning(f"the engine core did not stop within {timeout_s:g} s (a step "
                               "in progress, or it hangs): SIGTERM")
            # (Still loading: it reads no message yet, and SIGTERM ends it.)
            self._process.terminate()
            self._process.join(TERMINATE_WAIT_S)
        if self._process.is_alive():
            logger.warning(f"the engine core did not exit within {TERMINATE_WAIT_S:g} s of "
                           "SIGTERM: SIGKILL (its tensor-parallel workers see it gone)")
            self._process.kill()
            self._process.join()
        tasks = [task for task in (self._reader, self._watchdog) if task is not None]
        if loop is not None and loop.is_running():
            for task in tasks:
                loop.call_soon_threadsafe(task.cancel)
        elif loop is not None and tasks:
            # A loop that is not running (the chat's, between turns) would close with the
            # tasks still pending: cancel them and let them finish now.
            for task in tasks:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        self._context.destroy(linger=0)  # closes the output socket, then ends the context
        self._sync_context.destroy(linger=0)
        shutil.rmtree(self._ipc_dir, ignore_errors=True)  # sockets only; gone is fine

    # ------------------------------------------------------------------ requests
    def encode(self, prompt: str | list[int]) -> list[int]:
        """The prompt's token ids (a str is tokenized as LLMEngine.add_request does)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise refusal("prompt", prompt, "a list of int token ids (this model has no "
                              "tokenizer)")
            return list(self.tokenizer.encode(prompt))
        return list(prompt)

    def _check_running(self) -> None:
        if self.is_running:
            return
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine cannot take requests: {self.dead_error}"
                                  ) from self.dead_error
        if not self._closing:
            raise EngineDeadError("the engine cannot take requests: the engine core process "
                                  f"ended ({_describe_exit(self._process.exitcode)})")
        raise EngineDeadError("the engine cannot take requests: it is shutting down")

    async def generate(self, prompt: str | list[int], sampling_params: SamplingParams,
                       request_id: str | None = None, stop: Iterable[str] = (),
                       streamed: bool = True) -> AsyncGenerator[StreamOutput, None]:
        """Queue one request and yield its outputs as the engine produces them.

        streamed=False: the caller only wants the whole answer (a non-streaming HTTP request),
        so the engine need not keep the steps this request decodes in short.

        Bad input (the core's ValueError / TypeError) raises before the first output.
        Leaving the loop early (a client that went away, a cancelled task) aborts the request.
        """
        self.start()
        self._check_running()
        request_id = request_id if request_id is not None else uuid.uuid4().hex
        if request_id in self._by_request_id:
            raise refusal("request_id", request_id, "an id not already running")
        if not isinstance(sampling_params, SamplingParams):
            raise refusal("sampling_params", sampling_params, "a SamplingParams", TypeError)
        arrival = time.monotonic()
        # Checked here too (the core checks again), so that nothing malformed is ever sent.
        token_ids = check_token_ids(self.encode(prompt), self.vocab_size)
        check_sampling_token_ids(sampling_params, self.vocab_size)
        stop_token_ids = set(sampling_params.stop_token_ids or ())
        stop = list(stop)
        n = sampling_params.n
        # Per completion: its detokenizer, which also matches its stop strings.
        detoks: list[IncrementalDetokenizer | None] = [None] * n
        if self.tokenizer is not None:
            detoks = [IncrementalDetokenizer(self.tokenizer, token_ids, stop) for _ in range(n)]
        elif stop:
            raise refusal("stop", stop, "no stop strings: they need a tokenizer, and this model "
                          "has none")
        # As the core checks it, here before anything is sent (so no max_tokens larger than
        # MessagePack's ints, 2**64 - 1, is ever encoded).
        check_fits_context(len(token_ids), sampling_params.max_tokens, self.max_model_length)
        stream = _Stream(request_id, next(self._next_id), [_Completion() for _ in range(n)])
        self._streams[stream.core_id] = stream
        self._by_request_id[request_id] = stream
        # Per completion: the tokens it has yielded, and whether it has finished (for the
        # caller: a stop string finishes it here before the core hears of it).
        num_tokens = [0] * n
        finished = [False] * n
        ended = False  # its end (finished, stopped, aborted) went to the stat logger
        refused_or_dead = False
        try:
            self._send(AddRequest(stream.core_id, token_ids, sampling_params, streamed))
            last_time = None
            while True:
                await stream.wake.wait()
                stream.wake.clear()
                if stream.error is not None:
                    refused_or_dead = True  # nothing to abort
                    ended = True  # never started, or failed: not a finished request
                    raise stream.error
                now = time.monotonic()
                if stream.aborted and not stream.done:
                    self.stat_logger.record_finished("abort", now - arrival)
                    ended = True
                    for i in range(n):
                        if not finished[i]:
                            yield StreamOutput(request_id, "" if detoks[i] else None, [], True,
                                               "abort", len(token_ids), num_tokens[i], 0,
                                               index=i)
                    return
                for i, completion in enumerate(stream.completions):
                    if finished[i]:
                        continue
                    out = self._take_output(stream, completion, detoks[i], num_tokens[i], i,
                                            stop_token_ids)
                    if out is None:
                        continue
                    if last_time is None:
                        self.stat_logger.record_first_token(
                            now - arrival, stream.num_prompt_tokens, stream.num_cached_tokens)
                    if out.token_ids:
                        self.stat_logger.record_tokens(
                            len(out.token_ids), None if last_time is None else now - last_time)
                    last_time = now
                    num_tokens[i] = out.num_completion_tokens
                    finished[i] = out.finished
                    if out.finished and not completion.done and not all(finished):
                        # A stop string ended it, its siblings go on: it alone is aborted.
                        completion.done = True
                        self._send(AbortCompletion(stream.core_id, i))
                    if all(finished):
                        self.stat_logger.record_finished(out.finish_reason or "stop",
                                                         now - arrival)
                        ended = True
                    yield out
                if all(finished):
                    return
        finally:
            if not ended:  # left early: the client went away, or its task was cancelled
                self.stat_logger.record_finished("abort", time.monotonic() - arrival)
            del self._by_request_id[request_id]
            self._streams.pop(stream.core_id, None)
            if not (stream.done or refused_or_dead) and self.is_running:
                self._send(AbortRequests([stream.core_id]))

    @staticmethod
    def _take_output(stream: _Stream, completion: _Completion,
                     detok: IncrementalDetokenizer | None, num_tokens: int, index: int,
                     stop_token_ids: set[int]) -> StreamOutput | None:
        """A completion's news since its last output (num_tokens yielded so far), or None
        when there is none; a stop string finishes it."""
        core_finished = completion.finish_reason is not None
        if not completion.new_token_ids and not core_finished:
            return None  # (prompt logprobs wait for the completion's first tokens)
        new_ids, completion.new_token_ids = completion.new_token_ids, []
        logprobs, completion.logprobs = completion.logprobs, None
        prompt_logprobs, completion.prompt_logprobs = completion.prompt_logprobs, None
        text: str | None = None
        if detok is not None:
            # A stop token ends the request but not the text (vLLM): it stays in the token
            # ids, the detokenizer never sees it.
            stop_token = (completion.finish_reason == "stop" and bool(new_ids)
                          and new_ids[-1] in stop_token_ids)
            text = detok.add_tokens(new_ids[:-1] if stop_token else new_ids)
            kept = detok.num_tokens - num_tokens
            if stop_token and not detok.stopped:
                kept += 1
            new_ids = new_ids[:max(0, kept)]
            if logprobs is not None:  # none for the tokens after a stop string
                logprobs = logprobs.slice(0, len(new_ids))
            if core_finished or detok.stopped:
                text += detok.finish()
        stopped = detok is not None and detok.stopped
        finished = core_finished or stopped
        reason = "stop" if stopped else completion.finish_reason
        return StreamOutput(stream.request_id, text, new_ids, finished,
                            reason if finished else None, stream.num_prompt_tokens,
                            num_tokens + len(new_ids), stream.num_cached_tokens, logprobs,
                            prompt_logprobs, index)

    def abort(self, request_id: str) -> None:
        """Abort a request by the id given to generate(): its stream ends with finish_reason
        "abort" and its blocks are freed. Unknown or finished ids are ignored."""
        stream = self._by_request_id.get(request_id)
        if stream is None:
            return
        stream.aborted = True
        stream.wake.set()
        self._streams.pop(stream.core_id, None)
        self._send(AbortRequests([stream.core_id]))

    def _abort_streams(self) -> None:
        streams = list(self._by_request_id.values())
        for stream in streams:
            stream.aborted = True
            stream.wake.set()
        self._streams.clear()
        if streams and self._process.is_alive() and not self._input.closed:
            self._send(AbortRequests([s.core_id for s in streams]))

    def _send(self, message: Any) -> None:
        """Queue a message for the core without ever blocking: a PUSH socket with no peer
        (a core still loading, or gone) would block a plain send for good."""
        try:
            self._input.send(self._encoder.encode(message), zmq.NOBLOCK, copy=False)
        except zmq.Again:
            if isinstance(message, AddRequest):
                raise EngineDeadError("the engine core is not connected") from None
            logger.debug(f"the engine core is not connected: {type(message).__name__} dropped")

    # ------------------------------------------------------------------ core -> streams
    async def _read_outputs(self) -> None:
        """On the event loop, for the core's lifetime: route each message to its streams.

        The messages queued are taken together (up to MAX_MESSAGES_PER_TURN), then the
        streams run: each finds every step's tokens taken meanwhile and sends them as one
        output. Awaiting a message that is queued already does not give the loop to anyone
        else, so without the turn a reader slower than the core's steps (a loaded machine)
        would starve the streams for as long as the messages keep coming."""
        frame = await self._output.recv(copy=False)
        while True:
            for _ in range(MAX_MESSAGES_PER_TURN):
                if not self._handle(frame):
                    return
                # A message queued already comes as a finished future (pyzmq's asyncio
                # sockets return asyncio futures).
                next_frame = cast("asyncio.Future[Any]", self._output.recv(copy=False))
                if not next_frame.done():
                    break
                frame = next_frame.result()
            await asyncio.sleep(0)  # the streams' turn
            frame = await next_frame  # waits while nothing is queued

    def _handle(self, frame: Any) -> bool:
        """One message of the core; False once it says it died."""
        self._last_heard = time.monotonic()
        message = self._decoder.decode(frame.buffer)
        if isinstance(message, CoreDead):
            self._fail(EngineDeadError(message.message))
            return False
        if isinstance(message, Heartbeat):
            self._log_long_step(message.step_s)
        else:
            self._deliver(message)
        return True

    def _deliver(self, message: CoreOutputs) -> None:
        for refusal in message.refused:
            stream = self._streams.pop(refusal.request_id, None)
            if stream is not None:
                kind = TypeError if refusal.error_type == "TypeError" else ValueError
                stream.fail(kind(refusal.message))
        for out in message.outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # aborted meanwhile
            stream.push(out)
            if out.finish_reason is not None and stream.done:  # (only a finish ends it)
                del self._streams[out.request_id]
        stats = message.stats
        self.stat_logger.record_scheduler(stats.num_running, stats.num_waiting,
                                          stats.kv_cache_usage)
        if stats.spec_decode is not None:
            self.stat_logger.record_spec_decode(stats.spec_decode)

    def _log_long_step(self, step_s: float) -> None:
        if step_s < self._long_step_logged + LONG_STEP_LOG_S:
            if step_s < self._long_step_logged:
                self._long_step_logged = 0.0  # a new step
            return
        self._long_step_logged = step_s
        logger.warning(f"an engine step has been running for {step_s:.0f} s (a long prefill "
                       f"on a CPU, or a kernel that does not return)")

    async def _watch_core(self, timeout_s: float) -> None:
        """On the event loop: fail everything once the core was silent for timeout_s.

        Silence is measured from the last message read. A loop that was itself blocked (a
        long tokenization) wakes late to find the core's messages still queued: those count
        as heard, and so does a wake-up far behind schedule (the reader runs next).
        """
        expected = time.monotonic() + HANG_CHECK_S
        while True:
            await asyncio.sleep(HANG_CHECK_S)
            now = time.monotonic()
            late, expected = now - expected, now + HANG_CHECK_S
            pending = cast(int, self._output.get(zmq.EVENTS)) & zmq.POLLIN
            if late > HANG_CHECK_S or pending:
                self._last_heard = max(self._last_heard, now - HANG_CHECK_S)
                continue
            silent = now - self._last_heard
            if silent < timeout_s or not self._process.is_alive():
                continue  # (a process that ended is _on_core_exit's)
            error = EngineDeadError(
                f"the engine core process stopped answering: nothing from it for "
                f"{silent:.0f} s, though it is alive (process {self._process.pid}: stopped, "
                "or stuck in a step)")
            self._fail(error)
            logger.error(f"{error}; requests in flight were failed")
            for callback in self._death_callbacks:
                callback(error)
            return

    def _on_core_exit(self) -> None:
        """On the event loop: the core process ended (its sentinel became readable)."""
        assert self._loop is not None
        self._loop.remove_reader(self._process.sentinel)
        if self._shutdown_requested:
            return
        self._process.join(1)
        error = EngineDeadError("the engine core process died "
                                f"({_describe_exit(self._process.exitcode)})")
        if self.dead_error is None:
            self._fail(error)
        logger.error(f"{self.dead_error}; requests in flight were failed")
        for callback in self._death_callbacks:
            callback(self.dead_error or error)

    def fail_requests(self, error: BaseException) -> None:
        """End every request in flight with error and take no more, though this core lives:
        the engine it is a part of died (DPAsyncLLM, when another replica's core died). The
        core aborts them, so that it is idle, and quick to stop, when the shutdown comes."""
        core_ids = [stream.core_id for stream in self._by_request_id.values()]
        if core_ids and self._process.is_alive() and not self._input.closed:
            self._send(AbortRequests(core_ids))
        self._fail(error)

    def _fail(self, error: BaseException) -> None:
        """The core stopped: every request ends with the error."""
        if self.dead_error is None:
            self.dead_error = error
        for stream in self._by_request_id.values():
            stream.fail(EngineDeadError(str(error)))
        self._streams.clear()
