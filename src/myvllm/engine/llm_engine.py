"""Step 6: the LLMEngine, the engine in the caller's process: text in, text out.

    generate(prompts)
      -> tokenize and validate every prompt, then queue each in the EngineCore
      -> while not is_finished(): step()            one EngineCore.step()
      -> outputs in input order: text, token_ids, num_cached_tokens, and logprobs /
         prompt_logprobs (None unless SamplingParams asked for them); with
         SamplingParams.n > 1 also "outputs", one dict per completion (vLLM's
         RequestOutput.outputs), the top-level text and token_ids being completion 0's

The LLMEngine holds the tokenizer and an EngineCore (core.py): the scheduler, the model
runner and any tensor-parallel workers. It is the core's in-process client; the server and
the chat shell use the other one, AsyncLLM (async_llm.py), which runs the same core in a
process of its own.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from tqdm.auto import tqdm

from myvllm.config import Config
from myvllm.engine.batch import RequestOutput
from myvllm.engine.core import EngineCore
from myvllm.engine.generate_outputs import FinishedOutputs, generate_result
from myvllm.engine.sequence import Sequence
from myvllm.engine.startup import resolve_engine, to_config
from myvllm.sampling_parameters import SamplingParams
from myvllm.utils.gc_freeze import frozen_heap
from myvllm.utils.hf_config import gguf_parsed_once

logger = logging.getLogger("myvllm")

Prompt = str | list[int]


class LLMEngine:
    def __init__(self, model: Config | str | None = None, **kwargs: Any) -> None:
        config = to_config(model, **kwargs)
        if config.data_parallel_size != 1:
            raise ValueError(f"LLM runs one engine in this process; data_parallel_size="
                             f"{config.data_parallel_size} is for `myvllm serve` (one LLM per "
                             "GPU, each in its own process, is the offline equivalent)")
        with gguf_parsed_once():  # config, tokenizer and weights share one parse of a GGUF
            resolved = resolve_engine(config)
            self.model_path = resolved.model_path
            self.tokenizer = resolved.tokenizer
            self.engine_core = EngineCore(resolved.config, resolved.model_path,
                                          resolved.hf_config,
                                          fit_length_to_cache=resolved.fit_length_to_cache)
        core = self.engine_core
        # The engine's settings, resolved: max_model_length and eos from the checkpoint,
        # num_kvcache_blocks from memory.
        self.config: Config = core.config
        self.max_model_length: int = core.max_model_length
        self.vocab_size: int = core.vocab_size
        self.async_scheduling: bool = core.async_scheduling
        # Logprobs and n > 1 completions, gathered until their request finishes (step()).
        self.finished_outputs = FinishedOutputs()

    @property
    def scheduler(self) -> Any:
        return self.engine_core.scheduler

    @property
    def model_runner(self) -> Any:
        return self.engine_core.model_runner

    @property
    def dead_reason(self) -> str | None:
        """Why this engine can run no more steps, or None while it can (only under tensor
        parallelism: a worker died, a step failed, or exit() was called)."""
        return self.engine_core.dead_reason

    def check_alive(self) -> None:
        """Raise EngineDeadError if this engine can run no more steps (see dead_reason)."""
        self.engine_core.check_alive()

    def exit(self) -> None:
        """Stop the worker processes and release the process group (idempotent)."""
        self.engine_core.shutdown()

    # ------------------------------------------------------------------ requests
    def _make_sequence(self, prompt: Prompt, sampling_params: SamplingParams) -> Sequence:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"{self.model_path} has no tokenizer: pass prompts as lists "
                                 "of token ids.")
            prompt = self.tokenizer.encode(prompt)
        return self.engine_core.make_sequence(prompt, sampling_params)

    def add_request(self, prompt: Prompt, sampling_params: SamplingParams, *,
                    streamed: bool = True) -> int:
        """Queue one prompt; returns its request id. Bad input raises here, before anything
        is queued. streamed=False: nobody reads its tokens before it finishes, so the steps
        it decodes in need not stay short (see Config.max_prefill_tokens_while_decoding)."""
        self.check_alive()
        seq = self._make_sequence(prompt, sampling_params)
        seq.streamed = streamed
        return self._add_sequence(seq)

    def _add_sequence(self, seq: Sequence) -> int:
        self.finished_outputs.add(seq)
        return self.engine_core.add_sequence(seq)

    def abort(self, request_id: int) -> None:
        """Drop a request (all its completions) wherever it is and free its blocks now;
        unknown or finished ids are ignored (a request may finish while its client gives up
        on it)."""
        self.finished_outputs.forget(request_id)
        self.engine_core.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.engine_core.has_unfinished_requests()

    def is_finished(self) -> bool:
        return not self.engine_core.has_unfinished_requests()

    def step(self) -> tuple[list[dict[str, Any]], int]:
        """One scheduler step. Returns (the dicts of the requests that finished, tokens
        computed); engine/generate_outputs.py says what a dict holds. The token count is
        positive for a step that computes prompt tokens (with chunked prefill, the decode
        rows beside them count too) and negative for a pure decode step (one per sequence),
        so callers can tell them apart; it never exceeds max_num_batched_tokens.
        """
        outputs, num_tokens = self.step_outputs()
        return self.finished_outputs.collect(outputs), num_tokens

    def step_outputs(self) -> tuple[list[RequestOutput], int]:
        """One scheduler step, reported per request: every request that received tokens or
        finished in it, and the signed count of tokens computed (as step()). With
        async_scheduling both describe the step queued by the previous call (EngineCore.step
        draws the timeline)."""
        return self.engine_core.step()

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
            # Its outputs come back together at the end: no step's length is seen on its own,
            # only the total, so prompts need not wait beside its decoding sequences.
            seq.streamed = False
        for seq in seqs:
            self._add_sequence(seq)

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
        return [generate_result(outputs[seq.seq_id], seq.sampling_params.stop_token_ids,
                                self._decode) for seq in seqs]

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
        self.engine_core.drop_in_flight()
        for seq in seqs:
            self.abort(seq.seq_id)
        self.engine_core.executor.stop_workers_now()

