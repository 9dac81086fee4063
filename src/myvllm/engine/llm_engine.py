"""Step 6: the LLMEngine, the engine in the caller's process: text in, text out.

    generate(prompts)
      -> tokenize and check every prompt, then queue each in the EngineCore
      -> while not is_finished(): step()            one EngineCore.step()
      -> outputs in input order (engine/outputs.py says what each dict holds)

chat(messages) renders each conversation with the chat template (utils/chat_template.py, the
server's reading too) and runs generate() on the token ids.

It holds the tokenizer and an EngineCore (core.py), whose in-process client it is; the server
and the chat shell use the other client, AsyncLLM (async_llm.py).
"""

from __future__ import annotations

import numbers
import time
from typing import Any, cast

from myvllm.config import Config
from myvllm.engine.batch import RequestOutput
from myvllm.engine.core import EngineCore
from myvllm.engine.model_runner import ModelRunner
from myvllm.engine.queued_steps import abandon_generate
from myvllm.engine.outputs import GenerateProgress, finished_dict, generate_result
from myvllm.engine.request_checks import check_generate_args
from myvllm.engine.scheduler import Scheduler
from myvllm.engine.sequence import Sequence
from myvllm.engine.startup import check_in_process, resolve_engine, to_config
from myvllm.sample.finished_outputs import FinishedOutputs, gathering
from myvllm.sampling_parameters import SamplingParams
from myvllm.utils.chat_template import chat_prompt_ids, conversations
from myvllm.utils.gc_freeze import frozen_heap
from myvllm.utils.hf_config import gguf_parsed_once

Prompt = str | list[int]


class LLMEngine:
    def __init__(self, model: Config | str | None = None, **kwargs: Any) -> None:
        config = to_config(model, **kwargs)
        check_in_process(config)
        with gguf_parsed_once():  # config, tokenizer and weights share one parse of a GGUF
            resolved = resolve_engine(config)
            self.model_path = resolved.model_path
            self.tokenizer = resolved.tokenizer
            self.engine_core = EngineCore(resolved.config, resolved.model_path,
                                          resolved.hf_config,
                                          fit_length_to_cache=resolved.fit_length_to_cache)
        # The engine's settings, resolved: max_model_length and eos from the checkpoint,
        # num_kvcache_blocks from memory.
        self.config: Config = self.engine_core.config
        self.max_model_length: int = self.engine_core.max_model_length
        self.vocab_size: int = self.engine_core.vocab_size
        self.async_scheduling: bool = self.engine_core.async_scheduling
        # Logprobs and n > 1 completions, gathered until their request finishes (step());
        # made at the first request with extras (None: every finished output is a dict alone).
        self.finished_outputs: FinishedOutputs | None = None

    # ------------------------------------------------------------------ the core's parts
    @property
    def scheduler(self) -> Scheduler:
        return self.engine_core.scheduler

    @property
    def model_runner(self) -> ModelRunner:
        return self.engine_core.model_runner

    # ------------------------------------------------------------------ life
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
        is queued. streamed: as EngineCore.add_request."""
        self.check_alive()
        seq = self._make_sequence(prompt, sampling_params)
        seq.streamed = streamed
        return self._add_sequence(seq)

    def _add_sequence(self, seq: Sequence) -> int:
        if seq.extras is not None:  # it may ask for logprobs or n > 1 completions
            self.finished_outputs = gathering(self.finished_outputs, seq)
        return self.engine_core.add_sequence(seq)

    def abort(self, request_id: int) -> None:
        """Drop a request (all its completions) wherever it is and free its blocks now;
        unknown or finished ids are ignored."""
        if self.finished_outputs is not None:
            self.finished_outputs.forget(request_id)
        self.engine_core.abort(request_id)

    def step(self) -> tuple[list[dict[str, Any]], int]:
        """One scheduler step: (the dicts of the requests that finished, the signed count of
        tokens computed, as EngineCore.step)."""
        outputs, num_tokens = self.engine_core.step()
        if self.finished_outputs is not None:
            return self.finished_outputs.collect(outputs), num_tokens
        return [finished_dict(out) for out in outputs if out.finished], num_tokens

    def step_outputs(self) -> tuple[list[RequestOutput], int]:
        """One scheduler step, a RequestOutput per request that got tokens (for callers that
        stream): EngineCore.step."""
        return self.engine_core.step()

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[dict[str, Any]]:
        """Generate completions for all prompts (or one prompt: a str or one list of token
        ids, answered as a list of one, as vLLM does); outputs come back in input order."""
        one_prompt = isinstance(prompts, str) or (isinstance(prompts, list) and prompts
                                                   and isinstance(prompts[0], numbers.Integral))
        batch = cast("list[Prompt]", [prompts] if one_prompt else prompts)
        self.check_alive()
        params = check_generate_args(batch, sampling_params)
        # Check every prompt before queuing any: one bad prompt must not leave the others
        # half-submitted.
        seqs = [self._make_sequence(p, sp) for p, sp in zip(batch, params)]
        for seq in seqs:
            # Its outputs come back together at the end: no step's length is seen on its own,
            # only the total, so prompts need not wait beside its decoding sequences.
            seq.streamed = False
            self._add_sequence(seq)

        outputs: dict[int, dict[str, Any]] = {}
        progress = GenerateProgress(len(seqs), use_tqdm)
        try:
            with frozen_heap():  # no full garbage collection walks the engine mid-run
                while not self.is_finished():
                    start = time.perf_counter()
                    finished, num_tokens = self.step()
                    progress.step(len(finished), num_tokens, time.perf_counter() - start)
                    outputs.update((out["seq_id"], out) for out in finished)
        except BaseException:
            abandon_generate(self.engine_core, [seq.seq_id for seq in seqs], self.abort)
            raise
        finally:
            progress.close()
        return [generate_result(outputs[seq.seq_id], seq.sampling_params.stop_token_ids,
                                self._decode) for seq in seqs]

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[dict[str, Any]]:
        """generate() of one conversation (a list of {"role", "content"} dicts) or a list of
        them, each through the chat template as the server's /v1/chat/completions renders it
        (utils/chat_template.py): chat_template a Jinja template instead of the tokenizer's,
        add_generation_prompt=False leaves the assistant's turn unopened, tools (OpenAI's
        {"type": "function", "function": {...}} dicts) are shown to the model by templates
        that know them, chat_template_kwargs reach the template (e.g. {"enable_thinking":
        False}). Messages may carry tool calls (arguments as JSON text or a dict) and tool
        results ({"role": "tool", "tool_call_id", "content"}); the answer is text, as vLLM's
        LLM.chat gives it (the server's tool parsers read calls from it). A model with no
        tokenizer or chat template raises ValueError."""
        prompts: list[Prompt] = [
            chat_prompt_ids(self.tokenizer, conversation,
                            add_generation_prompt=add_generation_prompt,
                            chat_template=chat_template, template_kwargs=chat_template_kwargs,
                            tools=tools)
            for conversation in conversations(messages)]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _decode(self, token_ids: list[int]) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)
