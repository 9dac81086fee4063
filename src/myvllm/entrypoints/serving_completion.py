"""/v1/completions and /v1/chat/completions: prompts -> AsyncLLM.generate -> answers.

    request body (protocol.py) -> token ids of each prompt, checked here (PromptChecker)
      -> one AsyncLLM.generate per prompt, all queued at once, each awaited to its first
         output (so that the engine's refusal is still a plain 400, not an error inside a
         200 stream)
      -> stream=false: every prompt's text collected, one JSON body, choices in prompt order
         stream=true:  one server-sent event per output, "data: {...}\\n\\n", each carrying
                       its prompt's choice index, then "data: [DONE]\\n\\n"

A choice's text starts with its prompt's under completions' echo (in a stream's first event
of that choice), and its logprobs, when asked, come in each event for that event's tokens
(entrypoints/logprobs.py), the echoed prompt's first.

An answer may not grow past the server's bound (response_bounds.py: estimated from n, the
prompts, max_tokens, echo and logprobs, a 400 before anything is queued), and a non-streamed
answer is built and encoded in a worker thread, in pieces (json_chunks.py), as is a streamed
event with logprobs: the event loop keeps answering other clients (/health too) meanwhile.

A batch's prompts are separate requests to the engine (they share its batches like any
others); `n` completions of a prompt are one request, whose prompt is prefilled once and
shared (SamplingParams.n). The answer numbers the choices as OpenAI does: index = prompt
index * n + i for completion i of a prompt. Usage counts each prompt once and every
completion's tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from myvllm.serving.async_llm import EngineDeadError, StreamOutput
from myvllm.serving.engine_client import EngineClient
from myvllm.engine.request_checks import (check_max_tokens, check_prompt_length,
                                           check_token_ids)
from myvllm.entrypoints.chat_output_parsing import ChatOutputParsing
from myvllm.entrypoints.json_chunks import answer_bytes, answer_chunks, value_chunks
from myvllm.entrypoints.logprobs import ChoiceLogprobs, TokenTexts
from myvllm.entrypoints.protocol import (ChatCompletionRequest, CompletionRequest,
                                         RequestError, error_body)
from myvllm.entrypoints.request_log import request_log
from myvllm.entrypoints.safeguards.response_bounds import check_response_size
from myvllm.entrypoints.safeguards.server_limits import DEFAULT_MAX_RESPONSE_BYTES
from myvllm.entrypoints.responses import (Choice, CompletionEvents, chat_chunk, chat_response,
                                          completion_response, usage)
from myvllm.sampling_parameters import SamplingParams, check_max_tokens_value

# /v1/completions without max_tokens: OpenAI's default (or what is left of the context, if
# that is less). Chat without max_tokens may use the rest of the context, as vLLM does.
DEFAULT_COMPLETION_MAX_TOKENS = 16

# A request's first output, and the rest of its stream.
Started = tuple[StreamOutput, AsyncGenerator[StreamOutput, None]]


def sse(data: dict[str, Any] | str) -> str:
    """One server-sent event."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def large_sse(data: dict[str, Any]) -> str:
    """One server-sent event that may be large (logprobs), encoded in pieces (compact)."""
    return f"data: {''.join(answer_chunks(data))}\n\n"


def check_prompt(token_ids: list[int], max_tokens: int | None, max_model_length: int,
                 vocab_size: int, where: str = "") -> int:
    """The max_tokens to run a prompt with, or a RequestError (where: "prompt[3]: " in a
    batch). Given, max_tokens must be >= 1 and fit beside the prompt (check_max_tokens_value
    and request_checks.check_max_tokens: the library's checks and messages); not given, the
    default is what fits."""
    if max_tokens is not None:
        try:
            check_max_tokens_value(max_tokens)
        except ValueError as e:
            raise RequestError(str(e), param="max_tokens") from e
    try:
        check_token_ids(token_ids, vocab_size)
        check_prompt_length(len(token_ids), max_model_length)
    except (ValueError, TypeError) as e:
        raise RequestError(f"{where}{e}", param="prompt") from e
    if max_tokens is None:
        return max_model_length - len(token_ids)
    try:
        check_max_tokens(len(token_ids), max_tokens, max_model_length)
    except ValueError as e:
        raise RequestError(f"{where}{e}", param="max_tokens") from e
    return max_tokens


async def _disconnected(request: Request) -> None:
    """Return when the client closes the connection (the body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _with_first(first: StreamOutput, outputs: AsyncGenerator[StreamOutput, None]
                      ) -> AsyncGenerator[StreamOutput, None]:
    try:
        yield first
        async for out in outputs:
            yield out
    finally:  # closed early (client gone): close generate() now, which aborts the request
        await outputs.aclose()


async def _merge(started: list[Started]) -> AsyncGenerator[tuple[int, StreamOutput], None]:
    """The outputs of several requests as they come, each with its prompt index. One request
    (the usual case) is read directly, without a task and a queue between."""
    if len(started) == 1:
        async with contextlib.aclosing(_with_first(*started[0])) as outputs:
            async for out in outputs:
                yield 0, out
        return
    queue: asyncio.Queue[tuple[int, StreamOutput | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, first: StreamOutput,
                   outputs: AsyncGenerator[StreamOutput, None]) -> None:
        try:
            async for out in _with_first(first, outputs):
                queue.put_nowait((index, out))
        except Exception as e:  # the engine died: the reader raises it
            queue.put_nowait((index, e))
        queue.put_nowait((index, None))

    tasks = [asyncio.ensure_future(pump(i, *s)) for i, s in enumerate(started)]
    try:
        running = len(tasks)
        while running:
            index, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:  # left early (client gone, an error): the other requests are aborted
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@dataclass
class Answer:
    """What one choice adds to its outputs: the echoed prompt (completions' echo; "" once
    sent, or without echo) and its logprobs in the endpoint's shape."""

    echo: str
    logprobs: ChoiceLogprobs

    def logprobs_of(self, out: StreamOutput) -> dict[str, Any] | None:
        return self.logprobs.part(out.token_ids, out.logprobs, out.prompt_logprobs)


class Generation:
    """The routes that generate text, over one engine (an AsyncLLM, or a DPAsyncLLM's
    replicas) serving one model name; max_response_bytes bounds an answer's estimated size
    (response_bounds.py)."""

    def __init__(self, llm: EngineClient, model_name: str,
                 max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES) -> None:
        self.llm = llm
        self.model_name = model_name
        self.max_response_bytes = max_response_bytes
        self.token_texts = TokenTexts(llm.tokenizer)  # shared by every request's logprobs

    async def completions(self, request: Request, body: CompletionRequest) -> Response:
        batch = body.is_batch
        prompts = []
        for i, prompt in enumerate(body.prompts):
            try:
                prompts.append(self.llm.encode(prompt))
            except (ValueError, TypeError) as e:  # e.g. text for a model with no tokenizer
                raise RequestError(f"prompt[{i}]: {e}" if batch else str(e), param="prompt"
                                   ) from e
        default = body.max_tokens
        limits = [min(check_prompt(ids, default, self.llm.max_model_length,
                                   self.llm.vocab_size, f"prompt[{i}]: " if batch else ""),
                      DEFAULT_COMPLETION_MAX_TOKENS if default is None else default)
                  for i, ids in enumerate(prompts)]
        echo = None
        if body.echo:  # the prompt as given, or its token ids' text
            echo = [p if isinstance(p, str) else self._decode(ids)
                    for p, ids in zip(body.prompts, prompts)]
        return await self.run(request, body, prompts, limits, chat=False, echo=echo)

    def _decode(self, token_ids: list[int]) -> str:
        tokenizer = self.llm.tokenizer
        return "" if tokenizer is None else tokenizer.decode(token_ids)

    async def chat(self, request: Request, body: ChatCompletionRequest,
                   prompt_ids: list[int], parsing: ChatOutputParsing | None = None
                   ) -> Response:
        """parsing: how the answers are read (reasoning, tool calls); None: as text."""
        limit = check_prompt(prompt_ids, body.max_tokens, self.llm.max_model_length,
                             self.llm.vocab_size)
        return await self.run(request, body, [prompt_ids], [limit], chat=True,
                              parsing=parsing)

    async def run(self, request: Request, body: CompletionRequest | ChatCompletionRequest,
                  prompts: list[list[int]], max_tokens: list[int], chat: bool,
                  echo: list[str] | None = None, parsing: ChatOutputParsing | None = None
                  ) -> Response:
        """echo: each prompt's text, which its choice's text starts with; parsing: as
        chat's."""
        try:
            params = [body.sampling_params(m) for m in max_tokens]
        except (ValueError, TypeError) as e:
            raise RequestError(str(e)) from e
        check_response_size([len(ids) for ids in prompts], params, chat, echo is not None,
                            self.max_response_bytes)
        # One per choice: completion i of prompt k is choice k * n + i.
        n = body.num_completions
        answers = [Answer(echo[k] if echo else "",
                          ChoiceLogprobs(self.token_texts, p.logprobs is not None, chat,
                                         ids if echo else None))
                   for k, (ids, p) in enumerate(zip(prompts, params)) for _ in range(n)]
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        log = request_log(request)
        log.prompt_tokens = sum(map(len, prompts))
        if body.stream:
            started = await self.start(prompts, params, body.stop_strings, request_id, True)
            events = (self.stream_chat(request, request_id, started, answers,
                                       body.include_usage, parsing) if chat else
                      self.stream_completion(request, request_id, started, answers,
                                             body.include_usage))
            return StreamingResponse(events, media_type="text/event-stream")
        # Not streamed: the answer is one body; watch the connection while it is computed.
        collect = asyncio.ensure_future(
            self.collect(prompts, params, body.stop_strings, request_id, len(answers)))
        gone = asyncio.ensure_future(_disconnected(request))
        await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not collect.done():  # the client left: cancelling aborts the requests
            collect.cancel()
            log.reason = "the client went away before the answer was complete"
            return Response(status_code=499)  # nobody reads it
        gone.cancel()
        outputs = collect.result()
        ends = [choice_outputs[-1] for choice_outputs in outputs]
        log.completion_tokens = sum(out.num_completion_tokens for out in ends)
        if any(out.finish_reason == "abort" for out in ends):
            # Not the client's doing (its leaving cancels the task above): the server is
            # shutting down. A partial answer with a 200 would pass for a complete one.
            raise EngineDeadError("the server shut down before the answer was complete")
        usage_ = usage(log.prompt_tokens, log.completion_tokens)
        # Off the event loop: logprobs and echo may make this many megabytes.
        content = await asyncio.to_thread(self.answer, request_id, chat, answers, outputs,
                                          usage_, parsing)
        return Response(content, media_type="application/json")

    def answer(self, request_id: str, chat: bool, answers: list[Answer],
               outputs: list[list[StreamOutput]], usage_: dict[str, int],
               parsing: ChatOutputParsing | None) -> bytes:
        """A non-streamed answer's JSON, from each choice's outputs (in a worker thread)."""
        choices = [Choice(i, a.echo + "".join(out.text or "" for out in outs),
                          outs[-1].finish_reason,
                          a.logprobs.merge([a.logprobs_of(out) for out in outs]))
                   for i, (a, outs) in enumerate(zip(answers, outputs))]
        if parsing is not None:
            for choice in choices:
                choice.message, choice.finish_reason = parsing.message(choice.text,
                                                                       choice.finish_reason)
        build = chat_response if chat else completion_response
        return answer_bytes(build(request_id, self.model_name, choices, usage_))

    async def start(self, prompts: list[list[int]], params: list[SamplingParams],
                    stop: list[str], request_id: str, streamed: bool) -> list[Started]:
        """Queue every prompt at once and wait for each one's first output. A refusal
        (ValueError / TypeError from the engine) aborts the others and is a 400 naming the
        prompt in a batch."""
        batch = len(prompts) > 1
        streams = [self.llm.generate(ids, p, f"{request_id}-{i}" if batch else request_id,
                                     stop, streamed=streamed)
                   for i, (ids, p) in enumerate(zip(prompts, params))]
        firsts = await asyncio.gather(*(anext(s) for s in streams), return_exceptions=True)
        errors = [(i, e) for i, e in enumerate(firsts) if isinstance(e, BaseException)]
        if errors:
            await asyncio.gather(*(s.aclose() for s in streams), return_exceptions=True)
            i, error = errors[0]
            if isinstance(error, (ValueError, TypeError)):
                raise RequestError(f"prompt[{i}]: {error}" if batch else str(error)
                                   ) from error
            raise error
        return [(first, s) for first, s in zip(firsts, streams)
                if isinstance(first, StreamOutput)]

    async def collect(self, prompts: list[list[int]], params: list[SamplingParams],
                      stop: list[str], request_id: str, num_choices: int
                      ) -> list[list[StreamOutput]]:
        """Every choice's outputs, in choice order (each ends with a finished one)."""
        started = await self.start(prompts, params, stop, request_id, streamed=False)
        n = num_choices // len(prompts)
        outputs: list[list[StreamOutput]] = [[] for _ in range(num_choices)]
        async with contextlib.aclosing(_merge(started)) as merged:
            async for prompt_index, out in merged:
                outputs[prompt_index * n + out.index].append(out)
        # Every choice has an output once its request's outputs ended (a completion ends
        # with a finished output, aborted ones too).
        missing = [i for i, outs in enumerate(outputs) if not outs]
        if missing:
            raise RuntimeError(f"choice {missing[0]} got no output from the engine")
        return outputs

    async def stream_completion(self, request: Request, request_id: str,
                                started: list[Started], answers: list[Answer],
                                include_usage: bool) -> AsyncIterator[str]:
        n = len(answers) // len(started)
        last: list[StreamOutput | None] = [None] * len(answers)
        events = CompletionEvents(request_id, self.model_name)  # sse(completion_response(..))
        try:
            async with contextlib.aclosing(self._outputs(request, started)) as outputs:
                async for prompt_index, out in outputs:
                    index = prompt_index * n + out.index
                    last[index] = out
                    answer = answers[index]
                    # echo: the prompt's text leads the choice's first event.
                    text, answer.echo = answer.echo + (out.text or ""), ""
                    if answer.logprobs.asked:  # maybe large (an echoed prompt's): off the loop
                        yield await asyncio.to_thread(self.completion_event, events, index,
                                                      text, out, answer)
                    else:
                        yield events.event(Choice(index, text, out.finish_reason))
        except EngineDeadError as e:
            request_log(request).reason = str(e)
            yield sse(error_body(str(e), 503))
        num_completion_tokens = self._finish_log(request, last)
        if include_usage:
            yield sse(completion_response(request_id, self.model_name, [], usage(
                sum(first.num_prompt_tokens for first, _ in started), num_completion_tokens)))
        yield sse("[DONE]")

    async def stream_chat(self, request: Request, request_id: str, started: list[Started],
                          answers: list[Answer], include_usage: bool,
                          parsing: ChatOutputParsing | None = None) -> AsyncIterator[str]:
        streams = [parsing.stream() for _ in answers] if parsing is not None else None
        for index in range(len(answers)):  # one chat prompt: a choice per completion
            yield sse(chat_chunk(request_id, self.model_name,
                                 {"role": "assistant", "content": ""}, index=index))
        last: list[StreamOutput | None] = [None] * len(answers)
        try:
            async with contextlib.aclosing(self._outputs(request, started)) as outputs:
                async for _, out in outputs:
                    last[out.index] = out
                    finish_reason = out.finish_reason
                    if streams is None:
                        delta = {"content": out.text} if out.text else {}
                    else:
                        stream = streams[out.index]
                        delta = stream.delta(out.text or "", out.finished)
                        finish_reason = stream.finish_reason(finish_reason)
                    answer = answers[out.index]
                    if answer.logprobs.asked:  # maybe large: off the loop
                        yield await asyncio.to_thread(self.chat_event, request_id, out,
                                                      answer, delta, finish_reason)
                    else:
                        yield self.chat_event(request_id, out, answer, delta, finish_reason)
        except EngineDeadError as e:
            request_log(request).reason = str(e)
            yield sse(error_body(str(e), 503))
        num_completion_tokens = self._finish_log(request, last)
        if include_usage:
            yield sse(chat_chunk(request_id, self.model_name, None, None, usage(
                started[0][0].num_prompt_tokens, num_completion_tokens)))
        yield sse("[DONE]")

    @staticmethod
    def completion_event(events: CompletionEvents, index: int, text: str, out: StreamOutput,
                         answer: Answer) -> str:
        """An event with logprobs (in a worker thread): they are encoded in pieces."""
        logprobs = answer.logprobs_of(out)
        return events.event(Choice(index, text, out.finish_reason, logprobs),
                            logprobs_json="".join(value_chunks(logprobs)))

    def chat_event(self, request_id: str, out: StreamOutput, answer: Answer,
                   delta: dict[str, Any], finish_reason: str | None) -> str:
        body = chat_chunk(request_id, self.model_name, delta, finish_reason,
                          logprobs=answer.logprobs_of(out), index=out.index)
        return large_sse(body) if answer.logprobs.asked else sse(body)

    async def _outputs(self, request: Request, started: list[Started]
                       ) -> AsyncGenerator[tuple[int, StreamOutput], None]:
        """The outputs worth an event (new text or tokens, or the end); a stream closed
        early (the client went away) says so in the request's log line."""
        done = False
        try:
            async with contextlib.aclosing(_merge(started)) as outputs:
                async for index, out in outputs:
                    if out.text or out.token_ids or out.finished:
                        yield index, out
            done = True
        finally:
            if not done:
                request_log(request).reason = "the client went away during the stream"

    def _finish_log(self, request: Request, last: Sequence[StreamOutput | None]) -> int:
        """The completion tokens of all choices (a choice's last output counts them), also
        for the request's log line."""
        num_completion_tokens = sum(out.num_completion_tokens for out in last
                                    if out is not None)
        request_log(request).completion_tokens = num_completion_tokens
        return num_completion_tokens
