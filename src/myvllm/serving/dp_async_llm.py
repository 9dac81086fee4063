"""DPAsyncLLM: data parallelism, several whole engines behind one front end.

    llm = DPAsyncLLM(Config(model=..., data_parallel_size=2))   both replicas start at once
    async for out in llm.generate(prompt, params, "req-1"):      routed to one replica
        ...
    llm.shutdown()                                                every core process ends

    front end process (myvllm serve)
      DPAsyncLLM.generate: tokenize once, PrefixRouter.route (dp_router.py)
        -> replica r's AsyncLLM.generate        its own sockets, its own engine core process
    replica 0: AsyncLLM -> engine core process on GPUs 0 .. tp-1 (+ its tensor-parallel workers)
    replica 1: AsyncLLM -> engine core process on GPUs tp .. 2tp-1
    ...

Each replica is a plain AsyncLLM (its own core process, sockets, heartbeat, detokenizers),
started with CUDA_VISIBLE_DEVICES naming its GPUs, so the core and its tensor-parallel workers
see devices 0 .. tp-1 as always. What is shared: the tokenizer, and the stat logger (each
replica reports to an adapter that sums the replicas' queues before /metrics sees them).

A request lives on the replica that the router picked: all of its outputs come from there,
abort() goes there, and its n > 1 completions are forked there (they share its prompt's
blocks). The prompts of one batch are separate requests and may go to different replicas.

One engine, as the server sees it: is_running only while every replica runs (/health), and
when any replica's core dies (or hangs), every request in flight on every replica fails
with EngineDeadError naming the replica, no more are taken, and the on_core_death callbacks
run (the server exits 1): the same as one core's death, so a supervisor restarts the
whole server. Replicas that are left would otherwise serve on at a fraction of the capacity
behind a /health that says 503.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Iterable
import torch

from myvllm.config import Config
from myvllm.serving.async_llm import HANG_TIMEOUT_S, AsyncLLM, StatLogger, StreamOutput
from myvllm.serving.core_messages import SpecDecodeCounts
from myvllm.serving.dp_router import PrefixRouter
from myvllm.executor.errors import EngineDeadError
from myvllm.engine.startup import resolve_engine
from myvllm.sampling_parameters import SamplingParams
from myvllm.utils.device import resolve_device
from myvllm.utils.hf_config import gguf_parsed_once
from myvllm.value_checks import refusal

logger = logging.getLogger("myvllm")

__all__ = ["DPAsyncLLM", "replica_devices"]


def replica_devices(config: Config) -> list[str | None]:
    """Per replica, the CUDA_VISIBLE_DEVICES of its core process (None: leave it, on a CPU).

    Replica r takes the visible GPUs r*tp .. r*tp+tp-1 (of CUDA_VISIBLE_DEVICES when it is
    set, else of every GPU); more replicas x tensor_parallel_size than GPUs is an error."""
    dp, tp = config.data_parallel_size, config.tensor_parallel_size
    if resolve_device(config).type != "cuda":
        return [None] * dp  # every replica on the CPU, side by side
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    visible = ([d.strip() for d in listed.split(",") if d.strip()] if listed is not None
               else [str(i) for i in range(torch.cuda.device_count())])
    if dp * tp > len(visible):
        raise ValueError(f"data_parallel_size={dp} x tensor_parallel_size={tp} = {dp * tp} "
                         f"GPUs: allowed: at most the {len(visible)} visible"
                         + (f" (CUDA_VISIBLE_DEVICES={listed!r})" if listed is not None else ""))
    if tp > 1 and os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT"):
        # Each replica's tensor-parallel group would rendezvous on the same address.
        raise ValueError(f"MASTER_ADDR={os.environ['MASTER_ADDR']!r}, MASTER_PORT="
                         f"{os.environ['MASTER_PORT']!r} with data_parallel_size={dp} x "
                         f"tensor_parallel_size={tp}: allowed: both unset (each replica's "
                         "tensor-parallel group needs its own rendezvous port, and the "
                         "replicas pick free local ports)")
    return [",".join(visible[r * tp:(r + 1) * tp]) for r in range(dp)]


class _ReplicaStats(StatLogger):
    """One replica's reports, passed on to the server's stat logger: per-request events as
    they come (they add up by themselves), the queues and speculation's totals summed over
    every replica first (each core reports its own)."""

    def __init__(self, pool: _PooledStats, replica: int) -> None:
        self.pool = pool
        self.replica = replica

    def record_scheduler(self, num_running: int, num_waiting: int,
                         kv_cache_usage: float) -> None:
        self.pool.queues[self.replica] = (num_running, num_waiting, kv_cache_usage)
        self.pool.report_queues()

    def record_first_token(self, time_to_first_token: float, num_prompt_tokens: int,
                           num_cached_tokens: int) -> None:
        self.pool.target.record_first_token(time_to_first_token, num_prompt_tokens,
                                            num_cached_tokens)

    def record_tokens(self, num_tokens: int, inter_token_latency: float | None) -> None:
        self.pool.target.record_tokens(num_tokens, inter_token_latency)

    def record_finished(self, finish_reason: str, e2e_latency: float) -> None:
        self.pool.target.record_finished(finish_reason, e2e_latency)

    def record_spec_decode(self, counts: SpecDecodeCounts) -> None:
        self.pool.spec[self.replica] = counts
        self.pool.report_spec_decode()


class _PooledStats:
    def __init__(self, target: StatLogger, num_blocks: list[int]) -> None:
        self.target = target
        self.num_blocks = num_blocks  # each replica's KV blocks: weights its cache usage
        self.queues: list[tuple[int, int, float]] = [(0, 0, 0.0)] * len(num_blocks)
        self.spec: list[SpecDecodeCounts | None] = [None] * len(num_blocks)

    def report_queues(self) -> None:
        used = sum(usage * blocks for (_, _, usage), blocks in zip(self.queues, self.num_blocks))
        self.target.record_scheduler(sum(q[0] for q in self.queues),
                                     sum(q[1] for q in self.queues),
                                     used / max(1, sum(self.num_blocks)))

    def report_spec_decode(self) -> None:
        counts = [c for c in self.spec if c is not None]
        width = max(len(c.accepted_per_position) for c in counts)
        per_position = [sum(c.accepted_per_position[i] for c in counts
                            if i < len(c.accepted_per_position)) for i in range(width)]
        self.target.record_spec_decode(SpecDecodeCounts(
            sum(c.num_drafts for c in counts), sum(c.num_draft_tokens for c in counts),
            sum(c.num_accepted_tokens for c in counts), per_position))


class DPAsyncLLM:
    """config.data_parallel_size replicas of AsyncLLM's engine, one router in front.

    routing: "prefix" (dp_router.py: by prompt prefix, else the least loaded) or
    "round_robin" (the baseline it is measured against)."""

    def __init__(self, config: Config, stat_logger: StatLogger | None = None,
                 routing: str = "prefix",
                 hang_timeout_s: float | None = HANG_TIMEOUT_S) -> None:
        dp = config.data_parallel_size
        if dp < 2:
            raise refusal("DPAsyncLLM: Config.data_parallel_size", dp,
                          "an int >= 2 (one engine core is AsyncLLM)")
        devices = replica_devices(config)  # before anything starts: a clear error first
        with gguf_parsed_once():
            resolved = resolve_engine(config)
        if routing == "prefix" and not config.enable_prefix_caching:
            routing = "least_loaded"  # no cache to find a prefix in
            logger.info("Prefix caching is off: data-parallel routing by load alone.")
        self.router = PrefixRouter(dp, config.block_size, routing)  # checks routing
        one = dataclasses.replace(resolved, config=dataclasses.replace(resolved.config,
                                                                       data_parallel_size=1))
        self.tokenizer = resolved.tokenizer
        self.model_path = resolved.model_path
        self.dead_error: BaseException | None = None
        self._death_callbacks: list[Callable[[BaseException], None]] = []
        self._replica_of: dict[str, int] = {}  # request id -> its replica
        self.replicas: list[AsyncLLM] = []
        started = time.monotonic()
        try:
            for r, visible in enumerate(devices):
                environ = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
                self.replicas.append(AsyncLLM(one.config, None, hang_timeout_s, resolved=one,
                                              core_environ=environ, wait_until_ready=False))
            for r, replica in enumerate(self.replicas):
                try:
                    replica.wait_until_ready()
                except RuntimeError as e:
                    raise RuntimeError(f"data-parallel replica {r} of {dp}: {e}") from e
        except BaseException:
            for replica in self.replicas:
                replica.shutdown()
            raise
        for r, replica in enumerate(self.replicas):
            replica.on_core_death(functools.partial(self._on_replica_death, r))
        first = self.replicas[0]
        self.config = dataclasses.replace(first.config, data_parallel_size=dp)
        # The replicas may have sized their caches differently (a GPU with less memory free);
        # every prompt must fit whichever replica takes it.
        self.max_model_length = min(r.max_model_length for r in self.replicas)
        self.vocab_size = first.vocab_size
        self._stat_logger: StatLogger = StatLogger()
        self.stat_logger = stat_logger or StatLogger()
        where = ", ".join(f"GPUs {d}" if d is not None else "the CPU" for d in devices)
        logger.info(f"{dp} data-parallel replicas ready in {time.monotonic() - started:.0f} s "
                    f"(processes {self.core_pids}; {where}), routed by {routing}")

    # ------------------------------------------------------------------ lifecycle
    @property
    def stat_logger(self) -> StatLogger:
        return self._stat_logger

    @stat_logger.setter
    def stat_logger(self, target: StatLogger) -> None:
        """The server's logger: each replica reports to it through a _ReplicaStats."""
        self._stat_logger = target
        pool = _PooledStats(target, [r.config.num_kvcache_blocks for r in self.replicas])
        for i, replica in enumerate(self.replicas):
            replica.stat_logger = _ReplicaStats(pool, i)

    @property
    def core_pids(self) -> list[int | None]:
        """Each replica's engine core process."""
        return [replica.core_pid for replica in self.replicas]

    @property
    def is_running(self) -> bool:
        """True while requests are accepted: every replica runs."""
        return self.dead_error is None and all(r.is_running for r in self.replicas)

    def start(self) -> None:
        for replica in self.replicas:
            replica.start()

    def on_core_death(self, callback: Callable[[BaseException], None]) -> None:
        """Call callback(error) on the event loop when any replica's core dies unasked or
        stops answering (once)."""
        self._death_callbacks.append(callback)

    def _on_replica_death(self, replica: int, error: BaseException) -> None:
        if self.dead_error is not None:
            return  # another replica died first; its death was told
        dead = EngineDeadError(f"data-parallel replica {replica} of {len(self.replicas)}: "
                               f"{error}")
        self.dead_error = dead
        for i, other in enumerate(self.replicas):
            if i != replica:
                other.fail_requests(dead)
        for callback in self._death_callbacks:
            callback(dead)

    def abort_all(self) -> None:
        for replica in self.replicas:
            replica.abort_all()

    def shutdown(self) -> None:
        """Every replica's shutdown: each core told to stop first, then each waited for, so
        that they stop together (within seconds, whatever they are doing); idempotent."""
        for replica in self.replicas:
            replica.begin_shutdown()
        for replica in self.replicas:
            replica.shutdown()

    # ------------------------------------------------------------------ requests
    def encode(self, prompt: str | list[int]) -> list[int]:
        return self.replicas[0].encode(prompt)

    def _check_running(self) -> None:
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine cannot take requests: {self.dead_error}"
                                  ) from self.dead_error
        for r, replica in enumerate(self.replicas):
            if not replica.is_running:
                raise EngineDeadError(f"the engine cannot take requests: data-parallel "
                                      f"replica {r} is not running (shutting down)")

    async def generate(self, prompt: str | list[int], sampling_params: SamplingParams,
                       request_id: str | None = None, stop: Iterable[str] = (),
                       streamed: bool = True) -> AsyncGenerator[StreamOutput, None]:
        """AsyncLLM.generate on the replica the router picks for the prompt."""
        self.start()
        self._check_running()
        request_id = request_id if request_id is not None else uuid.uuid4().hex
        if request_id in self._replica_of:
            raise refusal("request_id", request_id, "an id not already running")
        if not isinstance(sampling_params, SamplingParams):
            raise refusal("sampling_params", sampling_params, "a SamplingParams", TypeError)
        token_ids = self.encode(prompt)  # once, here: the router reads the ids
        replica = self.router.route(token_ids)
        n = sampling_params.n
        self._replica_of[request_id] = replica
        self.router.started(replica, n)
        try:
            # aclosing: leaving early closes the replica's generator at once, which aborts
            # the request there (a generator merely dropped is closed whenever it is
            # collected).
            async with contextlib.aclosing(self.replicas[replica].generate(
                    token_ids, sampling_params, request_id, stop, streamed)) as outputs:
                async for out in outputs:
                    yield out
        finally:
            del self._replica_of[request_id]
            self.router.finished(replica, n)

    def replica_of(self, request_id: str) -> int | None:
        """The replica a running request went to (None: not running)."""
        return self._replica_of.get(request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request on its replica; unknown or finished ids are ignored."""
        replica = self._replica_of.get(request_id)
        if replica is not None:
            self.replicas[replica].abort(request_id)

    def __repr__(self) -> str:
        return (f"DPAsyncLLM({len(self.replicas)} replicas, routing={self.router.policy!r}, "
                f"processes={self.core_pids})")
