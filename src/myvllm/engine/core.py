"""Step 6, the inner loop: the EngineCore turns token ids into token ids, one step at a time.

It owns the Scheduler and the Executor (the model runner and any tensor-parallel workers) and
nothing else: no tokenizer, no text. Its clients are LLMEngine (llm_engine.py), in this
process, and AsyncLLM (async_llm.py), which runs it in a process of its own. One step:

    seqs, is_prefill = scheduler.schedule()
    sampled = executor.call("run", seqs, is_prefill)     (and every TP worker)
    scheduler.postprocess(seqs, sampled.token_ids())     (async_scheduling: one step later)
"""

from __future__ import annotations

import dataclasses
from typing import Any

from myvllm.config import Config
from myvllm.engine.batch import RequestOutput
from myvllm.engine.core_delegates import ExecutorDelegates
from myvllm.executor.executor import Executor
from myvllm.sample.logprobs import read_step_logprobs
from myvllm.engine.queued_steps import InFlight, QueuedStep, queued_step, undo_step
from myvllm.engine.request_checks import check_request
from myvllm.engine.request_outputs import request_outputs
from myvllm.sample.sampling import samples_this_step
from myvllm.engine.scheduler import Scheduler
from myvllm.engine.sequence import Sequence
from myvllm.spec_decode.verification import verified_token_lists
from myvllm.engine.startup import fit_max_model_length
from myvllm.structured_output.manager import StructuredOutputManager
from myvllm.sampling_parameters import SamplingParams
from myvllm.utils.device import resolve_device
from myvllm.utils.hf_config import gguf_parsed_once, load_hf_config


# model_runner, dead_reason, check_alive and shutdown pass straight on to the Executor
# (ExecutorDelegates).
class EngineCore(ExecutorDelegates):
    def __init__(self, config: Config, model_path: str, hf_config: Any = None, *,
                 fit_length_to_cache: bool = False) -> None:
        """config as the client resolved it (eos and max_model_length known); model_path a
        local checkpoint. fit_length_to_cache: see startup.fit_max_model_length."""
        with gguf_parsed_once():  # config and weights share one parse of a GGUF
            if hf_config is None:
                hf_config = load_hf_config(model_path)
            self.vocab_size: int = hf_config.vocab_size
            use_cuda = resolve_device(config).type == "cuda"
            self.executor = Executor(config, model_path, hf_config, use_cuda)
        try:
            num_blocks = self.executor.call("initialize_cache")
        except BaseException:
            self.executor.stop_workers_now()
            raise
        max_len = fit_max_model_length(config, num_blocks, fit_length_to_cache)
        # The engine's settings, resolved: max_model_length and eos from the checkpoint,
        # num_kvcache_blocks from memory.
        self.config = dataclasses.replace(config, num_kvcache_blocks=num_blocks,
                                          max_model_length=max_len)
        self.max_model_length: int = max_len
        self.scheduler = Scheduler(self.config)
        self.structured_outputs = StructuredOutputManager(
            model_path, hf_config.vocab_size, sorted(self.scheduler.eos_token_ids))
        self.async_scheduling = bool(config.async_scheduling)
        self._in_flight = InFlight(self.async_scheduling)  # the step not read yet (async)
        # Requests not yet finished or aborted, by request id (its first completion's seq_id):
        # its sequences, one per completion (SamplingParams.n).
        self._requests: dict[int, list[Sequence]] = {}

    @property
    def num_requests(self) -> int:
        """Requests added and not yet finished or aborted."""
        return len(self._requests)

    # ------------------------------------------------------------------ requests
    def make_sequence(self, token_ids: Any, sampling_params: SamplingParams) -> Sequence:
        """A request checked and made a Sequence, not queued (bad input raises here)."""
        seq = Sequence(check_request(token_ids, sampling_params, self.vocab_size),
                       self.config.block_size, sampling_params)
        # An empty or too long prompt, one that can never fit the KV cache: refused here.
        self.scheduler.check_sequence(seq)
        self.structured_outputs.add_matcher(seq)
        return seq

    def add_sequence(self, seq: Sequence) -> int:
        """Queue a sequence made by make_sequence (and its other completions, n > 1);
        returns its request id."""
        self.scheduler.add_sequence(seq)
        forks = seq.extras.forks if seq.extras is not None else []
        self._requests[seq.seq_id] = [seq, *forks]
        return seq.seq_id

    def add_request(self, token_ids: Any, sampling_params: SamplingParams, *,
                    streamed: bool = True) -> int:
        """Queue one prompt of token ids; returns its request id. streamed=False: nobody
        reads its tokens before it finishes, so the steps it decodes in need not stay short
        (Config.max_prefill_tokens_while_decoding)."""
        self.executor.check_alive()
        seq = self.make_sequence(token_ids, sampling_params)
        seq.streamed = streamed
        return self.add_sequence(seq)

    def abort(self, request_id: int, index: int | None = None) -> None:
        """Drop a request wherever it is and free its blocks now; unknown or finished ids
        are ignored (it may finish while its client gives up on it). index: only that
        completion of it (n > 1; a stop string ended it)."""
        seqs = self._requests.get(request_id)
        if seqs is None:
            return
        for seq in seqs if index is None else seqs[index:index + 1]:
            self.scheduler.abort(seq)
        if all(seq.is_finished for seq in seqs):
            del self._requests[request_id]

    def has_request(self, request_id: int) -> bool:
        """Added, and some completion of it not yet finished nor aborted."""
        return request_id in self._requests

    def drop_in_flight(self) -> None:
        """Forget a step in flight (after an error or Ctrl-C): InFlight.drop."""
        self._in_flight.drop()

    def abort_all(self) -> None:
        """Drop every request and any step in flight (at shutdown, or after an error)."""
        self.drop_in_flight()
        for request_id in list(self._requests):
            self.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return not self.scheduler.is_finished() or self._in_flight.step is not None

    # ------------------------------------------------------------------ the step
    def step(self) -> tuple[list[RequestOutput], int]:
        """One scheduler step: a RequestOutput per request that received tokens or finished
        in it, and the signed count of tokens computed (never above max_num_batched_tokens):
        > 0 for a step that computes prompt tokens (decode rows beside them count too), < 0
        for a pure decode step (one per sequence). With async_scheduling both describe the
        step queued by the previous call, which this call reads back after it queued the next
        (the guide's Step 6, "Async scheduling"), unless that one must be on the host before
        the next is planned (a grammar's next bitmask, speculation's accepted tokens)."""
        self.executor.check_alive()
        # A step in flight whose tokens the next schedule needs is read back first.
        constrained = self._in_flight.take_constrained()
        waited = self._read_back(constrained) if constrained is not None else None
        seqs, is_prefill = self.scheduler.schedule()
        queued = self._queue_step(seqs, is_prefill) if seqs else None
        queued = self._in_flight.swap(queued)  # async_scheduling: the step queued before
        if waited is not None:  # the step read back above (the one before is in flight)
            assert queued is None
            return waited
        if queued is None:  # nothing queued (or the first step of a run, still in flight)
            return [], 0
        return self._read_back(queued)

    def _queue_step(self, seqs: list[Sequence], is_prefill: bool) -> QueuedStep:
        """Run one step on every rank; its tokens are not waited for here."""
        samples = [samples_this_step(seq) for seq in seqs]
        num_tokens = sum(seq.num_new_tokens for seq in seqs) if is_prefill else -len(seqs)
        try:
            sampled = self.executor.call("run", seqs, is_prefill)
        except BaseException:
            undo_step(self.scheduler, seqs)  # none of its K/V was written
            raise
        return queued_step(seqs, num_tokens, sampled, samples, self.scheduler.speculator)

    def _read_back(self, step: QueuedStep) -> tuple[list[RequestOutput], int]:
        """Wait for a queued step's tokens and hand them to the scheduler."""
        with self.executor.watching_workers("run"):  # it may wait for a peer: a death raises
            token_ids = step.sampled.token_ids()
        logprobs = read_step_logprobs(step.seqs, step.sampled.logprobs)  # came with the tokens
        sampling = [i for i, sample in enumerate(step.samples) if sample]
        seqs = [step.seqs[i] for i in sampling]
        known = [len(seq.token_ids) for seq in seqs]
        # Speculative decoding: several tokens a row.
        verified = verified_token_lists(step.sampled.verified, sampling)
        self.scheduler.postprocess(seqs, [token_ids[i] for i in sampling], verified)
        outputs = request_outputs(seqs, known, [logprobs.get(i) for i in sampling],
                                  self._requests)
        return outputs, step.num_tokens

    def kv_cache_usage(self) -> float:
        """Fraction of the KV-cache blocks held by requests (cached free blocks are free)."""
        blocks = self.scheduler.block_manager
        return 1.0 - len(blocks.free_block_ids) / len(blocks.blocks)
