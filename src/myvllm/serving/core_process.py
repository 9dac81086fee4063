"""The engine core in a process of its own: a busy loop between two ZeroMQ sockets.

    front end process (AsyncLLM)                    core process (this file)
      spawn ---------------------------------------> run_engine_core(): EngineCore(...)
      wait for "ready" on a pipe <------------------ ("ready", settings) or ("error", traceback)
      input socket  -- AddRequest / AbortRequests -> busy loop:
                                                       take every waiting message (one
                                                       with a grammar waits outside the
                                                       scheduler while a thread compiles it)
                                                       queue those whose grammar is ready
                                                       step() if there is work
      output socket <- CoreOutputs, one per step ---   send the step's tokens (and, as a
                                                       step starts, the queues it runs with)

Why a process: the front end's Python (HTTP, JSON, tokenizing, detokenizing, server-sent
events) and the engine loop's Python (scheduling, building inputs) each need the
interpreter, and in one process they take turns on one GIL: measured on an H200 the server
then ran the bench workload at 0.57x of generate() (docs/serving.md). Here the engine loop
has an interpreter to itself and steps as fast as generate() does.

Lifetime: the front end owns this process. It sends Shutdown to stop it: read between steps,
the loop ends, the workers are stopped and the process exits 0 at once, without the
interpreter's own exit (utils/process_exit.py: on a busy CPU that alone outlasted the
front end's patience). A step cannot be cut short (a long prefill on a CPU runs for
seconds), so when Shutdown is not read in time the front end sends SIGTERM: between steps it
unwinds the loop as Shutdown does; inside a step the process exits at once with os._exit(0)
(nothing the step computes can reach anyone: no need to unwind a forward pass half done and
run the interpreter's exit behind it), and its workers, which watch it, follow within a
second. Ctrl-C in a terminal reaches every process of the group, so this one ignores SIGINT
and lets the front end decide. If the front end dies (kill -9), the parent-watch thread sees
it within a second and exits, and the tensor-parallel workers, which watch this process in
turn, follow.

Heartbeat: a thread sends a Heartbeat every HEARTBEAT_INTERVAL_S on a socket of its own,
whatever the loop does, with how long the step in progress has run. The front end takes a
silence of many intervals for a hung core (stopped, or stuck holding the interpreter), while a
step that is merely long (a 30k-token prefill on a CPU takes minutes) keeps the beat going.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection
from types import FrameType
from typing import TYPE_CHECKING, Any

import msgspec
import zmq

from myvllm.config import Config
from myvllm.engine.batch import RequestOutput
from myvllm.engine.block_manager import BlockManager
from myvllm.engine.core import EngineCore
from myvllm.engine.queued_steps import drop_in_flight
from myvllm.serving.core_messages import (AbortCompletion, AbortRequests, AddRequest, CoreDead,
                                         CoreInput, CoreOutput, CoreOutputs, Heartbeat,
                                         Refusal, SchedulerStats, Shutdown, SpecDecodeCounts)
from myvllm.executor.tp_workers import exit_when_parent_dies
from myvllm.utils.gc_freeze import frozen_heap
from myvllm.utils.process_exit import exit_without_finalizing

if TYPE_CHECKING:
    from myvllm.structured_output.held_requests import GrammarWaits

logger = logging.getLogger("myvllm")

# While idle, the loop wakes this often to see whether the engine died meanwhile (a
# tensor-parallel worker killed between requests), so it stops and says so at once.
IDLE_POLL_MS = 1000
# While requests wait for their grammars (and nothing steps), it wakes this often to queue
# those whose grammar a compile thread has finished.
GRAMMAR_POLL_MS = 10
PARENT_CHECK_S = 0.5  # how often the core looks whether the front end is still there
LINGER_MS = 2000  # at exit, how long queued output messages may take to leave
# How often the heartbeat thread tells the front end that this process is alive. The front
# end's hang limit is many of these (async_llm.HANG_TIMEOUT_S).
HEARTBEAT_INTERVAL_S = 1.0

# When the step in progress began (time.monotonic()), None between steps: read by the
# SIGTERM handler and the heartbeat thread. One process runs one loop.
_step_started: float | None = None


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    if _step_started is None:
        raise SystemExit(0)  # unwinds the loop, so the workers are stopped on the way out
    # Python runs this handler between two bytecodes of the step (after the torch op in
    # progress returns). The step's results can go nowhere: leave now, without unwinding it.
    os.write(2, b"[myvllm] the engine core got SIGTERM in the middle of a step: exit now\n")
    os._exit(0)


def run_engine_core(config: Config, model_path: str, fit_length_to_cache: bool,
                    input_address: str, output_address: str, ready: Connection,
                    parent_pid: int) -> None:
    """Entry point of the core process (importable: the process is spawned)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _on_sigterm)
    threading.Thread(target=exit_when_parent_dies,
                     args=(parent_pid, PARENT_CHECK_S, "the engine core"), daemon=True,
                     name="myvllm-parent-watch").start()
    try:
        core = EngineCore(config, model_path, fit_length_to_cache=fit_length_to_cache)
    except BaseException:
        # The front end shows the traceback (AsyncLLM raises with it); printing it here too
        # would say everything twice.
        ready.send(("error", traceback.format_exc()))
        sys.exit(1)
    try:
        # Connected before "ready": the front end then waits until its input socket has a
        # peer, so its first request cannot find the socket unconnected.
        proc = EngineCoreProc(core, input_address, output_address)
        ready.send(("ready", {"config": core.config, "vocab_size": core.vocab_size,
                              "max_model_length": core.max_model_length}))
        ready.close()
        proc.start_heartbeat(output_address)
        proc.run_busy_loop()
    except SystemExit:
        pass  # SIGTERM between steps (_on_sigterm): the loop is unwound, stop as on Shutdown
    finally:
        core.shutdown()
    exit_without_finalizing()


class EngineCoreProc:
    """The busy loop around one EngineCore and its two sockets."""

    def __init__(self, core: EngineCore, input_address: str, output_address: str,
                 context: zmq.Context[Any] | None = None) -> None:
        self.core = core
        self._owns_context = context is None
        self._context = context or zmq.Context()
        self.input = self._context.socket(zmq.PULL)
        self.input.connect(input_address)
        self.output = self._context.socket(zmq.PUSH)
        self.output.setsockopt(zmq.SNDHWM, 0)  # never block a step on a slow front end
        self.output.setsockopt(zmq.LINGER, LINGER_MS)
        self.output.connect(output_address)
        self._decoder = msgspec.msgpack.Decoder(CoreInput)
        self._encoder = msgspec.msgpack.Encoder()
        # The front end names requests by its own ids; the core by sequence ids.
        self._core_ids: dict[int, int] = {}  # front end id -> core id
        self._front_ids: dict[int, int] = {}  # core id -> front end id
        self._refused: list[Refusal] = []
        # Requests with structured outputs waiting for their grammar, outside the scheduler
        # (made at the first; a compile never runs in this loop).
        self._grammar_waits: GrammarWaits | None = None
        self._last_stats: SchedulerStats | None = None
        self._heartbeat: HeartbeatThread | None = None
        # The queues as the step about to run leaves them (a prefill is running, its blocks
        # held), sent before it runs: a step can take a minute on a CPU.
        core.on_step_start = lambda: self._send([])

    def start_heartbeat(self, output_address: str,
                        interval_s: float = HEARTBEAT_INTERVAL_S) -> None:
        """Beat until close() (the core process does; the loop's own tests need not)."""
        self._heartbeat = HeartbeatThread(self._context, output_address, interval_s)

    def run_busy_loop(self) -> None:
        core = self.core
        try:
            # The engine lives as long as this loop: no full garbage collection walks it.
            with frozen_heap():
                while True:
                    # Block for a message only when there is nothing to step.
                    if not self._take_inputs(block=not core.has_unfinished_requests(),
                                             poll_ms=GRAMMAR_POLL_MS if self._grammar_waits
                                             else IDLE_POLL_MS):
                        break
                    self._admit_compiled()
                    outputs: list[RequestOutput] = []
                    if core.has_unfinished_requests():
                        outputs = self._step()
                    self._send([self._to_output(out) for out in outputs])
            abort_all(core)  # Shutdown: every block back, and the front end hears it
            self._send([])
        except Exception as e:
            logger.exception("the engine loop failed")
            self._send_dead(f"the engine loop failed: {type(e).__name__}: {e}")
            raise
        finally:
            self.close()

    def _step(self) -> list[RequestOutput]:
        global _step_started
        _step_started = time.monotonic()
        try:
            return self.core.step()[0]
        finally:
            _step_started = None

    def close(self) -> None:
        """Close both sockets (what is queued for the front end may take LINGER_MS to
        leave), and the ZeroMQ context if this object made it; idempotent."""
        self.core.on_step_start = None  # its socket is closing
        if self._heartbeat is not None:
            self._heartbeat.stop()
        self.input.close(linger=0)
        self.output.close()
        if self._owns_context:
            self._context.term()

    def _take_inputs(self, block: bool, poll_ms: int = IDLE_POLL_MS) -> bool:
        """Apply every message waiting (waiting up to poll_ms for one when block); False
        once Shutdown arrived."""
        if block and not self.input.poll(poll_ms):
            self.core.check_alive()  # raises once the engine died while idle
            return True
        while True:
            try:
                frame = self.input.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return True
            message = self._decoder.decode(frame.buffer)
            if isinstance(message, Shutdown):
                return False
            if isinstance(message, AddRequest):
                self._add(message)
            else:
                self._abort(message)

    def _add(self, message: AddRequest) -> None:
        try:
            if message.sampling_params.structured_outputs is not None:
                self._hold_for_grammar(message)
                return
            core_id = self.core.add_request(message.prompt_token_ids, message.sampling_params,
                                            streamed=message.streamed)
        except (ValueError, TypeError) as e:  # bad input: that request's error only
            self._refused.append(Refusal(message.request_id, type(e).__name__, str(e)))
            return
        self._register(message.request_id, core_id)

    def _register(self, front_id: int, core_id: int) -> None:
        self._core_ids[front_id] = core_id
        self._front_ids[core_id] = front_id

    def _hold_for_grammar(self, message: AddRequest) -> None:
        """Check the request now, and hold it until a compile thread has built its grammar
        (a big grammar takes seconds: never in this loop, where it would stop every step)."""
        seq = self.core.make_sequence(message.prompt_token_ids, message.sampling_params,
                                      with_grammar=False)
        seq.streamed = message.streamed
        if self._grammar_waits is None:
            assert self.core.structured_outputs is not None  # made by make_sequence
            self._grammar_waits = self.core.structured_outputs.waits
        self._grammar_waits.hold(message.request_id, seq)

    def _admit_compiled(self) -> None:
        """Queue the held requests whose grammar is ready; refuse those whose grammar failed
        to compile or ran past its time limit."""
        if not self._grammar_waits:
            return
        for front_id, ready in self._grammar_waits.take_ready():
            if isinstance(ready, ValueError):
                self._refused.append(Refusal(front_id, "ValueError", str(ready)))
            else:
                self._register(front_id, self.core.add_sequence(ready))

    def _abort(self, message: AbortRequests | AbortCompletion) -> None:
        if isinstance(message, AbortCompletion):
            core_id = self._core_ids.get(message.request_id)
            if core_id is not None:
                self.core.abort(core_id, message.index)
                if core_id not in self.core.requests:  # it was the last one running
                    del self._core_ids[message.request_id], self._front_ids[core_id]
            return
        for front_id in message.request_ids:
            core_id = self._core_ids.pop(front_id, None)
            if core_id is not None:
                del self._front_ids[core_id]
                self.core.abort(core_id)
            elif self._grammar_waits is not None:  # maybe still waiting for its grammar
                self._grammar_waits.drop(front_id)

    def _to_output(self, out: RequestOutput) -> CoreOutput:
        front_id = self._front_ids[out.request_id]
        if out.request_finished:
            del self._front_ids[out.request_id]
            del self._core_ids[front_id]
        # A fork's prompt logprobs are those of its request's first completion (the same
        # lists, sent with its first output): sent once, AsyncLLM gives them to every
        # completion. n=128 with echo sent 128 copies, decoded on the front end's event loop.
        prompt_logprobs = out.prompt_logprobs if out.index == 0 else None
        return CoreOutput(front_id, out.new_token_ids, out.finish_reason,
                          out.num_prompt_tokens, out.num_cached_tokens, out.logprobs,
                          prompt_logprobs, out.index)

    def _send(self, outputs: list[CoreOutput]) -> None:
        """One message for the step, unless it has nothing new to say."""
        scheduler = self.core.scheduler
        spec = None
        if scheduler.speculator is not None:
            counts = scheduler.speculator.stats
            spec = SpecDecodeCounts(counts.num_drafts, counts.num_draft_tokens,
                                    counts.num_accepted_tokens,
                                    list(counts.accepted_per_position))
        # Those waiting for their grammar wait too, outside the scheduler.
        waiting = len(scheduler.waiting) + len(self._grammar_waits or ())
        stats = SchedulerStats(len(scheduler.running), waiting,
                               kv_cache_usage(scheduler.block_manager), spec)
        if not outputs and not self._refused and stats == self._last_stats:
            return
        message = CoreOutputs(outputs, self._refused, stats)
        self._refused = []
        self._last_stats = stats
        self.output.send(self._encoder.encode(message), copy=False)

    def _send_dead(self, message: str) -> None:
        self.output.send(self._encoder.encode(CoreDead(message)))


class HeartbeatThread:
    """A Heartbeat to the front end every interval_s, from a daemon thread, until stop().

    Its own socket (a ZeroMQ socket belongs to one thread; the front end's PULL socket takes
    messages from both). A beat needs the interpreter only for a moment, which torch ops
    leave free while they compute, so a long step does not silence it; a process that is
    stopped (SIGSTOP, a debugger) or stuck in C code holding the interpreter does.
    """

    def __init__(self, context: zmq.Context[Any], output_address: str,
                 interval_s: float = HEARTBEAT_INTERVAL_S) -> None:
        self._socket = context.socket(zmq.PUSH)
        self._socket.setsockopt(zmq.SNDHWM, 16)  # a front end that reads nothing: dropped
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(output_address)
        self._interval_s = interval_s
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="myvllm-heartbeat")
        self._thread.start()

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        try:
            while not self._stopped.is_set():
                started = _step_started
                step_s = 0.0 if started is None else time.monotonic() - started
                try:
                    self._socket.send(encoder.encode(Heartbeat(step_s)), zmq.NOBLOCK)
                except zmq.Again:
                    pass  # the front end is behind; the next beat says the same
                self._stopped.wait(self._interval_s)
        finally:
            self._socket.close()  # here: the socket is this thread's

    def stop(self) -> None:
        """End the thread and close its socket (before the context is terminated)."""
        self._stopped.set()
        self._thread.join()


def abort_all(core: EngineCore) -> None:
    """Drop every request and any step in flight (at shutdown, or after an error)."""
    drop_in_flight(core)
    for request_id in list(core.requests):
        core.abort(request_id)


def kv_cache_usage(blocks: BlockManager) -> float:
    """Fraction of the KV-cache blocks held by requests (cached free blocks are free)."""
    return 1.0 - len(blocks.free_block_ids) / len(blocks.blocks)
