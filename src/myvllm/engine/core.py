"""Step 6, the inner loop: the EngineCore turns token ids into token ids, one step at a time.

It owns the Scheduler and rank 0's ModelRunner, and under tensor parallelism the Executor of
the worker processes (executor/executor.py; None with one rank), and nothing else: no
tokenizer, no text. Its clients are LLMEngine (llm_engine.py), in this process, and AsyncLLM
(async_llm.py), which runs it in a process of its own. One step:

    seqs, is_prefill = scheduler.schedule()
    sampled = model_runner.run(seqs, is_prefill)     (workers.call("run", ...): every rank)
    scheduler.postprocess(seqs, sampled.token_ids())

With async_scheduling the step's tokens are read back one call later, after the next step
is queued (engine/queued_steps.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from myvllm.config import Config
from myvllm.engine.batch import RequestOutput
from myvllm.engine.model_runner import samples_this_step
from myvllm.engine.outputs import request_outputs
from myvllm.engine.queued_steps import InFlight, QueuedStep, read_features, undo_step
from myvllm.engine.request_checks import check_fits_context, check_request
from myvllm.engine.scheduler import Scheduler
from myvllm.engine.sequence import Sequence
from myvllm.engine.core_parts import start_core_parts, stop_core_parts
from myvllm.sample.forks import make_forks
from myvllm.sampling_parameters import SamplingParams
from myvllm.spec_decode.scheduling import make_speculator
from myvllm.structured_output.manager import StructuredOutputManager, manager_for


class EngineCore:
    def __init__(self, config: Config, model_path: str, hf_config: Any = None, *,
                 fit_length_to_cache: bool = False) -> None:
        """config as the client resolved it (eos and max_model_length known); model_path a
        local checkpoint. fit_length_to_cache: see startup.fit_max_model_length. The parts
        (threads, workers or the ModelRunner, a draft model, the KV cache) are built in
        order by engine/core_parts.py."""
        parts = start_core_parts(self, config, model_path, hf_config, fit_length_to_cache)
        # The engine's settings, resolved: max_model_length and eos from the checkpoint,
        # num_kvcache_blocks from memory.
        self.config = parts.config
        self.max_model_length = parts.max_model_length
        self.vocab_size = parts.vocab_size
        self.model_runner = parts.model_runner
        # Tensor parallelism: the worker processes (ranks 1..N-1), None with one rank.
        self.workers = parts.workers
        self._restore_threads = parts.restore_threads
        # Speculative decoding: the proposer the scheduler asks for a decode row's proposals
        # (None when off; the runner's verifier is made with the runner).
        self.scheduler = Scheduler(self.config, make_speculator(self.config))
        self.model_path = model_path
        # The grammar compiler and cache: None until the first request that asks for
        # structured outputs (structured_output/manager.py's manager_for makes it).
        self.structured_outputs: StructuredOutputManager | None = None
        self.async_scheduling = bool(config.async_scheduling)
        # async_scheduling: the step queued and not read yet (None without it; after an error
        # or Ctrl-C, queued_steps.drop_in_flight forgets it).
        self.in_flight = InFlight() if self.async_scheduling else None
        # Requests not yet finished or aborted, by request id (its first completion's seq_id):
        # its sequences, one per completion (SamplingParams.n).
        self.requests: dict[int, list[Sequence]] = {}
        # Called as each step starts, once scheduled (the server reports the queues); or None.
        self.on_step_start: Callable[[], None] | None = None

    # ------------------------------------------------------------------ life
    @property
    def dead_reason(self) -> str | None:
        """Why this engine can run no more steps (tensor parallelism: a worker died, a step
        failed, or shutdown() was called), or None. One process never dies this way."""
        return None if self.workers is None else self.workers.dead_reason

    def check_alive(self) -> None:
        """Raise EngineDeadError if this engine can run no more steps (see dead_reason)."""
        if self.workers is not None:
            self.workers.check_alive()

    def shutdown(self) -> None:
        """Stop the worker processes and release the process group, and give the caller its
        own thread count back (idempotent)."""
        stop_core_parts(self.workers, self._restore_threads)

    # ------------------------------------------------------------------ requests
    def make_sequence(self, token_ids: Any, sampling_params: SamplingParams, *,
                      with_grammar: bool = True) -> Sequence:
        """A request checked and made a Sequence, not queued (bad input raises here).
        A request for structured outputs makes the engine's manager (self.structured_outputs)
        if it is the first; with_grammar=False: its grammar is not compiled here, the core
        process holds it until a compile thread has (structured_output/held_requests.py)."""
        seq = Sequence(check_request(token_ids, sampling_params, self.vocab_size),
                       self.config.block_size, sampling_params)
        # A prompt too long, or max_tokens that does not fit beside it (the server's 400 says
        # the same), an empty prompt, one that can never fit the KV cache: refused here.
        check_fits_context(seq.num_prompt_tokens, sampling_params.max_tokens,
                           self.max_model_length)
        self.scheduler.check_sequence(seq)
        if sampling_params.structured_outputs is not None:
            manager = manager_for(self)
            if with_grammar:
                manager.add_matcher(seq)  # waits for the compile
        return seq

    def add_sequence(self, seq: Sequence) -> int:
        """Queue a sequence made by make_sequence; returns its request id. With
        SamplingParams.n > 1 the request's other completions are made here, outside the
        scheduler, as vLLM fans a request out (sample/forks.py)."""
        self.scheduler.add_sequence(seq)
        forks = make_forks(seq) if seq.sampling_params.n > 1 else []
        self.requests[seq.seq_id] = [seq, *forks]
        return seq.seq_id

    def add_request(self, token_ids: Any, sampling_params: SamplingParams, *,
                    streamed: bool = True) -> int:
        """Queue one prompt of token ids; returns its request id. streamed=False: nobody
        reads its tokens before it finishes, so the steps it decodes in need not stay short
        (Config.max_prefill_tokens_while_decoding)."""
        self.check_alive()
        seq = self.make_sequence(token_ids, sampling_params)
        seq.streamed = streamed
        return self.add_sequence(seq)

    def abort(self, request_id: int, index: int | None = None) -> None:
        """Drop a request wherever it is and free its blocks now; unknown or finished ids
        are ignored (it may finish while its client gives up on it). index: only that
        completion of it (n > 1; a stop string ended it)."""
        seqs = self.requests.get(request_id)
        if seqs is None:
            return
        for seq in seqs if index is None else seqs[index:index + 1]:
            self.scheduler.abort(seq)
        if all(seq.is_finished for seq in seqs):
            del self.requests[request_id]

    def has_unfinished_requests(self) -> bool:
        return not self.scheduler.is_finished() or (
            self.in_flight is not None and self.in_flight.step is not None)

    # ------------------------------------------------------------------ the step
    def step(self) -> tuple[list[RequestOutput], int]:
        """One scheduler step: a RequestOutput per request that received tokens or finished
        in it, and the signed count of tokens computed (never above max_num_batched_tokens):
        > 0 for a step that computes prompt tokens (decode rows beside them count too), < 0
        for a pure decode step (one per sequence). With async_scheduling both describe the
        step queued by the previous call (InFlight.step_through)."""
        self.check_alive()
        if self.in_flight is not None:  # async scheduling
            return self.in_flight.step_through(self)
        seqs, is_prefill = self.scheduler.schedule()
        if not seqs:
            return [], 0
        step = self.run_step(seqs, is_prefill)
        return self.read_back(step), step.num_tokens

    def run_step(self, seqs: list[Sequence], is_prefill: bool) -> QueuedStep:
        """Run one step on every rank; its tokens are not waited for here."""
        if self.on_step_start is not None:
            self.on_step_start()
        samples = [samples_this_step(seq) for seq in seqs]
        try:
            # Under tensor parallelism every rank runs it.
            sampled = (self.model_runner.run(seqs, is_prefill) if self.workers is None
                       else self.workers.call("run", seqs, is_prefill))
        except BaseException:
            undo_step(self.scheduler, seqs)  # none of its K/V was written
            raise
        assert sampled is not None  # rank 0's tokens
        num_tokens = sum(seq.num_new_tokens for seq in seqs) if is_prefill else -len(seqs)
        return QueuedStep(seqs, num_tokens, sampled, samples)

    def read_back(self, step: QueuedStep) -> list[RequestOutput]:
        """Wait for a step's tokens and hand them to the scheduler (only the rows that sample
        in it: a chunk short of its prompt's end gets no token)."""
        # Under tensor parallelism it may wait for a peer: a death raises.
        token_ids = (step.sampled.token_ids() if self.workers is None
                     else self.workers.token_ids(step.sampled))
        sampling = [i for i, sample in enumerate(step.samples) if sample]
        rows = [step.seqs[i] for i in sampling]
        known = [len(seq.token_ids) for seq in rows]
        # Logprobs came with the tokens if a row asked; speculative decoding: several
        # tokens a row (queued_steps.read_features reads both).
        logprobs, verified = ((None, None) if step.sampled.logprobs is None
                              and step.sampled.verified is None
                              else read_features(step, sampling))
        self.scheduler.postprocess(rows, [token_ids[i] for i in sampling], verified)
        return request_outputs(rows, known, logprobs, self.requests)
