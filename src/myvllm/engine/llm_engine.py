"""Step 6: the LLMEngine ties tokenizer, scheduler and model runner together.

    generate(prompts)
      -> validate every prompt, then add_request() each: Sequence -> scheduler.waiting
      -> while not is_finished(): step()
             seqs, is_prefill = scheduler.schedule()
             sampled = model_runner.run(seqs, is_prefill)     (and every TP worker)
             scheduler.postprocess(seqs, sampled.token_ids())
      -> outputs in input order: text, token_ids, num_cached_tokens

With async_scheduling the last line runs one step later, so the host plans and queues step
N+1 while the device still computes step N (see step()).

The ModelRunner is created before the Scheduler because only the runner can tell how many
KV-cache blocks fit in memory, and the scheduler's BlockManager is built with that count.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import numbers
import os
import time
import weakref
from collections.abc import Iterator
from collections.abc import Sequence as SequenceABC
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from myvllm.config import Config
from myvllm.engine.batch import RequestOutput
from myvllm.engine.errors import EngineDeadError
from myvllm.engine.model_runner import ModelRunner, SampledTokens
from myvllm.engine.sampling import samples_this_step
from myvllm.engine.scheduler import Scheduler
from myvllm.engine.sequence import Sequence
from myvllm.engine.tp_workers import (WorkerPool, init_distributed, nccl_abort,
                                      pick_init_method, release_process_group)
from myvllm.layers.linear import check_tp_divides_heads
from myvllm.models import get_model_class
from myvllm.sampling_parameters import SamplingParams
from myvllm.utils.device import resolve_device
from myvllm.utils.gc_freeze import frozen_heap
from myvllm.utils.hf_config import (eos_token_ids, gguf_parsed_once, load_hf_config,
                                    load_tokenizer)
from myvllm.utils.model_path import resolve_model_path

logger = logging.getLogger("myvllm")

Prompt = str | list[int]

# After rank 0's side of a step failed: how long to wait for a worker's death to explain it
# (a worker that raised sends its traceback, then exits; a killed one is usually gone already).
WORKER_EXIT_WAIT_S = 2.0


@dataclasses.dataclass
class _QueuedStep:
    """A step whose tokens are on their way (ModelRunner.run returned, nobody waited)."""

    seqs: list[Sequence]
    num_tokens: int  # what step() reports: > 0 prompt tokens computed, < 0 decode
    sampled: SampledTokens  # rank 0's run() result
    # Which of seqs get their token (chunked prefill: not those whose prompt goes on).
    samples: list[bool]


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _tokenizer_if_any(model_path: str) -> Any:
    """The checkpoint's tokenizer, or None for a weights-only checkpoint (token-id prompts).

    Random-weight checkpoints built for tests and benchmarks carry no tokenizer; they are
    driven with token ids, and their outputs have text None.
    """
    path = Path(model_path)
    if path.suffix == ".gguf" or any((path / name).is_file() for name in TOKENIZER_FILES):
        return load_tokenizer(model_path)
    return None


def _shutdown(pool: WorkerPool | None, owns_process_group: bool, torch_threads: int | None,
              runner: ModelRunner | None = None, graceful: bool = True) -> None:
    """Release workers and the process group, restore the thread count; safe to call twice
    (weakref.finalize runs it at most once).

    graceful=False after an error: a worker may be stuck in a collective, so the workers are
    stopped first and the group is aborted rather than torn down together.
    """
    graceful = graceful and (pool is None or pool.all_alive())
    if pool is not None:
        if graceful:
            pool.request_exit()  # the workers destroy their side while we destroy ours
        else:
            pool.shutdown(wait_s=0)
    if owns_process_group and dist.is_initialized():
        if runner is not None:
            runner.release_cuda_graphs()  # before the group: see release_cuda_graphs
        release_process_group(graceful)
    if pool is not None:
        pool.shutdown()
    if torch_threads is not None:
        torch.set_num_threads(torch_threads)


class LLMEngine:
    def __init__(self, model: Config | str | None = None, **kwargs: Any) -> None:
        with gguf_parsed_once():  # config, tokenizer and weights share one parse of a GGUF
            self._build(model, **kwargs)

    def _build(self, model: Config | str | None, **kwargs: Any) -> None:
        if isinstance(model, Config):
            config = dataclasses.replace(model, **kwargs) if kwargs else model
        else:
            config = Config.from_dict({"model": model, **kwargs})
        # Dummy weights need only config.json (and a tokenizer, when there is one).
        self.model_path = resolve_model_path(config.model,
                                             weights=config.load_format != "dummy")
        hf_config = load_hf_config(self.model_path)
        get_model_class(getattr(hf_config, "architectures", None) or [])  # unknown -> error now
        self._check_tensor_parallel(config, hf_config)
        self.tokenizer = _tokenizer_if_any(self.model_path)
        eos = config.eos
        if eos is None:  # -1 when the checkpoint names no eos: stop on max_tokens only
            eos = eos_token_ids(self.model_path, hf_config, self.tokenizer) or -1
        max_len: int = hf_config.max_position_embeddings
        user_max_len = config.max_model_length
        if config.max_model_length is not None:
            if config.max_model_length > max_len:
                logger.info(f"max_model_length {config.max_model_length} -> {max_len}: the "
                            "checkpoint's max_position_embeddings")
            max_len = min(config.max_model_length, max_len)
        config = dataclasses.replace(config, eos=eos, max_model_length=max_len)
        self.vocab_size: int = hf_config.vocab_size

        use_cuda = resolve_device(config).type == "cuda"
        if config.async_scheduling is None:
            # On where it is measured to pay: on GPUs, one or several (over NCCL, two H200s:
            # Qwen3-8B's shape at batch 1 went from 7.6 to 7.0 ms a token). Off on a CPU, where
            # the host and the "device" are the same cores. Resolved before any worker starts:
            # every rank's ModelRunner must know whether the next step may read this step's
            # tokens from the device (ModelRunner.run).
            config = dataclasses.replace(config, async_scheduling=use_cuda)
        if not use_cuda and not config.enforce_eager:
            logger.info("No GPU: CUDA graphs are off, decoding runs eagerly on the CPU.")
        self._pool: WorkerPool | None = None
        self._finalizer: weakref.finalize | None = None
        self._dead_reason: str | None = None  # set when a tensor-parallel step fails
        owns_group = config.tensor_parallel_size > 1
        torch_threads = None  # the caller's thread count, restored at shutdown if we change it
        if owns_group and not use_cuda:
            # N ranks share this machine's cores: give rank 0 its share, as the workers do,
            # or OpenMP threads of different ranks stall each other at every barrier.
            torch_threads = torch.get_num_threads()
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // config.tensor_parallel_size))
        try:
            if owns_group:
                init_method = pick_init_method()
                self._pool = WorkerPool(config, self.model_path, init_method, use_cuda)
                self._pool.wait_for("alive")
                init_distributed(config, 0, init_method, use_cuda)
                abort = nccl_abort() if use_cuda else None
                if abort is not None:  # gloo needs none: a dead peer's sockets close
                    self._pool.watchdog.call_on_death(abort)
            self.model_runner = ModelRunner(config, 0, self.model_path, hf_config)
            if self._pool is not None:
                self._pool.wait_for("ready")
            num_blocks = self._call("initialize_cache")
        except BaseException:
            _shutdown(self._pool, owns_group, torch_threads, getattr(self, "model_runner", None),
                      graceful=False)
            raise
        capacity = num_blocks * config.block_size
        if user_max_len is None and max_len > capacity:
            # The checkpoint's length, but one sequence could never grow so long here. (A
            # length the caller chose stays: add_request refuses what can never fit.)
            logger.info(f"max_model_length {max_len} -> {capacity}: what the KV cache holds "
                        f"({num_blocks} blocks of {config.block_size} tokens)")
            max_len = capacity
        # The engine's settings, resolved: max_model_length and eos from the checkpoint,
        # num_kvcache_blocks from memory.
        self.config = dataclasses.replace(config, num_kvcache_blocks=num_blocks,
                                          max_model_length=max_len)
        self.max_model_length: int = max_len
        self.scheduler = Scheduler(self.config)
        self.async_scheduling: bool = bool(config.async_scheduling)
        self._in_flight: _QueuedStep | None = None  # async_scheduling: the step not yet read
        # The requests added and not yet finished or aborted, by request id (= seq_id).
        self._requests: dict[int, Sequence] = {}
        # Runs on exit(), on garbage collection, and at interpreter exit, whichever is first.
        # The runner is passed only with tensor parallelism, where its graphs must go before
        # the process group; otherwise the finalizer would keep its GPU memory alive.
        self._finalizer = weakref.finalize(self, _shutdown, self._pool, owns_group,
                                           torch_threads,
                                           self.model_runner if owns_group else None)

    @staticmethod
    def _check_tensor_parallel(config: Config, hf_config: Any) -> None:
        """Before any worker starts: the heads split evenly, and there are enough GPUs."""
        tp = config.tensor_parallel_size
        heads = hf_config.num_attention_heads
        check_tp_divides_heads(tp, heads, getattr(hf_config, "num_key_value_heads", heads))
        if tp > 1 and resolve_device(config).type == "cuda" and tp > torch.cuda.device_count():
            raise ValueError(f"tensor_parallel_size={tp} but only {torch.cuda.device_count()} "
                             "CUDA devices are visible.")

    # ------------------------------------------------------------------ plumbing
    def _call(self, method: str, *args: Any) -> Any:
        """Run a ModelRunner method on every rank (workers first, they block on NCCL/gloo)."""
        if self._pool is None:
            return getattr(self.model_runner, method)(*args)
        self.check_alive()
        with self._watching_workers(method):
            self._pool.send(method, *args)
            return getattr(self.model_runner, method)(*args)

    @contextlib.contextmanager
    def _watching_workers(self, method: str) -> Iterator[None]:
        """Rank 0's part of a collective step; a worker's death or error is raised from it.

        A dead worker makes rank 0's part fail (gloo: the peer's socket closed) or return
        early with garbage (NCCL: the watchdog aborted the communicator, tp_watchdog.py).
        Either way the worker's death, and its traceback if it sent one, is what the caller
        sees, and the engine stops: the ranks are out of step for good.
        """
        pool = self._pool
        if pool is None:
            yield
            return
        try:
            yield
        except Exception as e:
            death = pool.watchdog.find_failure(wait_s=WORKER_EXIT_WAIT_S)
            traceback = pool.reported_error()
            if death is None and traceback is None:
                raise  # rank 0's own error: generate() still stops the workers
            raise self._worker_failed(method, death, traceback) from e
        if pool.failure is not None:  # returned, but after the abort: nothing in it is true
            raise self._worker_failed(method, pool.failure, pool.reported_error())

    def _worker_failed(self, method: str, death: str | None,
                       traceback: str | None) -> EngineDeadError:
        """Stop this engine after a worker failed in `method`; the error to raise."""
        message = death or "a tensor-parallel worker failed"
        self._dead_reason = message
        self.exit()
        detail = f":\n{traceback}" if traceback else ""
        return EngineDeadError(f"{message} during {method}(); this engine stopped its "
                               f"workers and cannot continue (build a new one){detail}")

    @property
    def dead_reason(self) -> str | None:
        """Why this engine can run no more steps, or None while it can.

        Only under tensor parallelism: a worker died (noticed by the watchdog even while the
        engine is idle), a step failed, or exit() was called. One process has nothing to get
        out of step, and an engine of size 1 keeps working after an error.
        """
        if self._pool is None:
            return None
        if self._dead_reason is not None:
            return self._dead_reason
        if self._pool.failure is not None:
            return self._pool.failure
        if self._pool.closed:
            return "this engine was shut down (exit() or an earlier failure)"
        return None

    def check_alive(self) -> None:
        """Raise EngineDeadError if this engine can run no more steps (see dead_reason)."""
        reason = self.dead_reason
        if reason is None:
            return
        self.exit()  # a worker that died while the engine was idle: stop the others now
        raise EngineDeadError(f"This engine cannot run: {reason}. Build a new engine.")

    def exit(self) -> None:
        """Stop the worker processes and release the process group (idempotent)."""
        if self._finalizer is not None:
            self._finalizer()

    # ------------------------------------------------------------------ requests
    def _make_sequence(self, prompt: Prompt, sampling_params: SamplingParams) -> Sequence:
        if not isinstance(sampling_params, SamplingParams):
            raise TypeError(f"sampling_params must be SamplingParams, got "
                            f"{type(sampling_params).__name__}")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"{self.model_path} has no tokenizer: pass prompts as lists "
                                 "of token ids.")
            token_ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, SequenceABC) and not isinstance(prompt, (bytes, bytearray)):
            # bytes are a sequence of ints too, but they are text, not token ids.
            token_ids = list(prompt)
            # Plain ints pass with one C-level check. A Python-level isinstance() per token
            # took 13-25 ms for a 16k-token prompt on a 2-core machine: host time between two
            # steps, which every decoding stream waited for.
            if set(map(type, token_ids)) - {int}:
                bad_types = [t for t in token_ids
                             if not isinstance(t, numbers.Integral) or isinstance(t, bool)]
                if bad_types:
                    raise TypeError(f"token ids must be ints, got {bad_types[0]!r} "
                                    f"({type(bad_types[0]).__name__}) in a prompt")
                token_ids = [int(t) for t in token_ids]  # numpy ints are fine, stored as int
            if token_ids and not (0 <= min(token_ids) and max(token_ids) < self.vocab_size):
                bad = next(t for t in token_ids if not 0 <= t < self.vocab_size)
                raise ValueError(f"token id {bad} is outside the vocabulary "
                                 f"[0, {self.vocab_size}).")
        else:
            raise TypeError("a prompt must be a str or a list of int token ids, got "
                            f"{type(prompt).__name__}")
        # An empty prompt is refused by Scheduler.check_sequence, before anything is queued.
        return Sequence(token_ids, self.config.block_size, sampling_params)

    def add_request(self, prompt: Prompt, sampling_params: SamplingParams, *,
                    streamed: bool = True) -> int:
        """Queue one prompt; returns its request id. Bad input raises here, before anything
        is queued. streamed=False: nobody reads its tokens before it finishes (a server's
        non-streaming request), so the steps it decodes in need not stay short (see
        Config.max_prefill_tokens_while_decoding)."""
        self.check_alive()
        seq = self._make_sequence(prompt, sampling_params)
        seq.streamed = streamed
        self.scheduler.add_sequence(seq)
        self._requests[seq.seq_id] = seq
        return seq.seq_id

    def abort(self, request_id: int) -> None:
        """Drop a request wherever it is and free its blocks now; unknown or finished ids
        are ignored (a request may finish while its client gives up on it)."""
        seq = self._requests.pop(request_id, None)
        if seq is not None:
            self.scheduler.abort(seq)

    def has_unfinished_requests(self) -> bool:
        return not self.is_finished()

    def step(self) -> tuple[list[dict[str, Any]], int]:
        """One scheduler step. Returns (outputs of the sequences that finished, tokens computed).

        Each output has seq_id, token_ids (completion only) and num_cached_tokens. The token
        count is positive for a step that computes prompt tokens (with chunked prefill, the
        decode rows beside them count too) and negative for a pure decode step (one per
        sequence), so callers can tell them apart; it never exceeds max_num_batched_tokens.
        """
        outputs, num_tokens = self.step_outputs()
        finished = [{"seq_id": out.request_id, "token_ids": out.token_ids,
                     "num_cached_tokens": out.num_cached_tokens}
                    for out in outputs if out.finished]
        return finished, num_tokens

    def step_outputs(self) -> tuple[list[RequestOutput], int]:
        """One scheduler step, reported per request: every request that received tokens or
        finished in it, and the signed count of tokens computed (as step()).

        With async_scheduling, both describe the step queued by the previous call: this call
        plans and queues the next step first, and only then waits for the previous one's
        tokens, so the device always has the next step to run while the host works:

            host:    schedule N+1 | queue N+1 | wait N, postprocess N | schedule N+2 | ...
            device:  ....... step N ........ | ........ step N+1 ......... | ...

        Step N+1 is planned before step N's tokens are known: each sequence counts its token
        as pending (Sequence.add_pending_token), the runner feeds it from the device, and a
        sequence that ends on eos has one surplus step computed, whose token is dropped.
        """
        self.check_alive()
        seqs, is_prefill = self.scheduler.schedule()
        queued = None
        if seqs:
            if self.config.enable_chunked_prefill:
                samples = [samples_this_step(seq) for seq in seqs]
                num_computed = sum(seq.num_new_tokens for seq in seqs)
            else:
                samples = [True] * len(seqs)
                num_computed = sum(len(seq) - seq.num_cached_tokens for seq in seqs)
            num_tokens = num_computed if is_prefill else -len(seqs)
            try:
                sampled = self._call("run", seqs, is_prefill)
            except BaseException:
                self._undo_step(seqs, is_prefill)
                raise
            for seq, sample in zip(seqs, samples, strict=True):
                if sample:
                    seq.add_pending_token()
            queued = _QueuedStep(seqs, num_tokens, sampled, samples)
        if self.async_scheduling:
            queued, self._in_flight = self._in_flight, queued
        if queued is None:  # nothing queued (or the first step of a run, still in flight)
            return [], 0
        return self._read_back(queued)

    def _undo_step(self, seqs: list[Sequence], is_prefill: bool) -> None:
        """A step failed before it ran (Ctrl-C, out of memory): none of its K/V was written.
        The blocks it was to fill were registered for prefix hits when it was scheduled, so
        they are unregistered, and its sequences go back to waiting to be recomputed (one
        admitted in this step may hold a hit on a block that another row of this step was to
        write).

        What was written before the step: with chunked prefill, every position below the
        step's chunk; without, a prefill's cached prefix, or all but a decode row's last
        token."""
        block_manager = self.scheduler.block_manager
        for seq in seqs:
            if self.config.enable_chunked_prefill:
                seq.num_computed_tokens -= seq.num_new_tokens
                written = seq.num_computed_tokens
            else:
                written = seq.num_cached_tokens if is_prefill else len(seq) - 1
            block_manager.unregister_after(seq, written)
        for seq in seqs:
            if not seq.is_finished:
                self.scheduler.preempt(seq)

    def _read_back(self, step: _QueuedStep) -> tuple[list[RequestOutput], int]:
        """Wait for a queued step's tokens and hand them to the scheduler."""
        with self._watching_workers("run"):  # under NCCL, rank 0 waits here for its peers
            token_ids = step.sampled.token_ids()
        seqs = [seq for seq, sample in zip(step.seqs, step.samples, strict=True) if sample]
        known = [len(seq.token_ids) for seq in seqs]
        self.scheduler.postprocess(
            seqs, [t for t, sample in zip(token_ids, step.samples, strict=True) if sample])
        outputs = []
        for seq, num_known in zip(seqs, known, strict=True):
            new_token_ids = seq.token_ids[num_known:]
            if not new_token_ids:  # a surplus token of a sequence that had finished
                continue
            if seq.is_finished:
                self._requests.pop(seq.seq_id, None)
            outputs.append(RequestOutput(
                request_id=seq.seq_id, new_token_ids=new_token_ids,
                token_ids=seq.completion_token_ids, finished=seq.is_finished,
                finish_reason=seq.finish_reason, num_prompt_tokens=seq.num_prompt_tokens,
                num_cached_tokens=seq.num_cached_prompt_tokens or 0))
        return outputs, step.num_tokens

    def is_finished(self) -> bool:
        return self.scheduler.is_finished() and self._in_flight is None

    def generate(
        self,
        prompts: list[Prompt],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[dict[str, Any]]:
        """Generate completions for all prompts; outputs come back in input order."""
        self.check_alive()
        if isinstance(prompts, str):
            raise TypeError("prompts must be a list (of strings or token-id lists), "
                            "not a single string.")
        if not isinstance(prompts, (list, tuple)):
            raise TypeError("prompts must be a list of strings or token-id lists, got "
                            f"{type(prompts).__name__}")
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        elif not isinstance(sampling_params, (list, tuple)):
            # A dict would otherwise be iterated as its keys and reported as a str.
            raise TypeError("sampling_params must be a SamplingParams or a list of them, got "
                            f"{type(sampling_params).__name__}")
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} sampling_params for "
                             f"{len(prompts)} prompts; pass one, or one per prompt.")
        # Validate everything before queuing anything: one bad prompt must not leave the
        # others half-submitted.
        seqs = [self._make_sequence(p, sp) for p, sp in zip(prompts, sampling_params)]
        for seq in seqs:
            self.scheduler.check_sequence(seq)
            # Its outputs come back together at the end: no step's length is seen on its own,
            # only the total, so prompts need not wait beside its decoding sequences.
            seq.streamed = False
        for seq in seqs:
            self.scheduler.add_sequence(seq)
            self._requests[seq.seq_id] = seq

        outputs: dict[int, dict[str, Any]] = {}
        progress = tqdm(total=len(seqs), desc="Generating", dynamic_ncols=True,
                        disable=not use_tqdm)
        prefill_tps = decode_tps = 0.0
        try:
            with frozen_heap():  # no full garbage collection walks the engine mid-run
                while not self.is_finished():
                    start = time.perf_counter()
                    finished, num_tokens = self.step()
                    elapsed = time.perf_counter() - start
                    if num_tokens > 0:
                        prefill_tps = num_tokens / elapsed
                    else:
                        decode_tps = -num_tokens / elapsed
                    progress.set_postfix(prefill=f"{prefill_tps:.0f}tok/s",
                                         decode=f"{decode_tps:.0f}tok/s")
                    for out in finished:
                        outputs[out["seq_id"]] = out
                        progress.update(1)
        except BaseException:
            self._abort(seqs)
            raise
        finally:
            progress.close()
        return [
            {
                "text": self._decode(outputs[seq.seq_id]["token_ids"]),
                "token_ids": outputs[seq.seq_id]["token_ids"],
                "num_cached_tokens": outputs[seq.seq_id]["num_cached_tokens"],
            }
            for seq in seqs
        ]

    def _decode(self, token_ids: list[int]) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def _abort(self, seqs: list[Sequence]) -> None:
        """After an error or Ctrl-C mid-generate: drop this call's sequences.

        With one rank the engine stays usable. With tensor parallelism the ranks may have
        been interrupted in different places (one inside a collective, one not), so the
        workers are stopped and the engine refuses further work.
        """
        # A step in flight is abandoned: its sequences forget their pending token and the
        # next step recomputes it (the device runs steps in order, so nothing it still
        # writes can land on a later step's data).
        if self._in_flight is not None:
            for seq in self._in_flight.seqs:
                seq.drop_pending_tokens()
            self._in_flight = None
        for seq in seqs:
            self.abort(seq.seq_id)
        if self._pool is not None:
            self._pool.shutdown(wait_s=0)
            self.exit()
