"""The OpenAI-compatible HTTP server: FastAPI routes over an AsyncLLM.

    GET  /health               200 while the engine accepts requests, else 503
    GET  /v1/models            the one model served
    POST /v1/completions       prompt (text or token ids) -> text
    POST /v1/chat/completions  messages -> the tokenizer's chat template -> text
    GET  /metrics              Prometheus text (see metrics.py)

A request's way through this file (the engine side is in myvllm/engine/async_llm.py):

    body bytes (a 413 over the size limit)
      --parse_request--> CompletionRequest (strict; a mistake is a 400)
      -> token ids, SamplingParams -> AsyncLLM.generate(...) -> async iterator of StreamOutput
      -> stream=false: collect the text, one JSON body
         stream=true:  one server-sent event per output, "data: {...}\\n\\n", then
                       "data: [DONE]\\n\\n"

Client mistakes never reach the engine loop as exceptions: the body is validated here, and
the engine's own checks (prompt longer than max_model_length, token id out of the
vocabulary, a bad sampling value) raise ValueError/TypeError from generate() before any
output, which becomes a 400 with OpenAI's error JSON. A client that disconnects cancels the
task reading its outputs, and generate() aborts the request when it is left early.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from types import FrameType
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from myvllm.engine.async_llm import AsyncLLM, EngineDeadError, StreamOutput
from myvllm.entrypoints import protocol
from myvllm.entrypoints.metrics import CONTENT_TYPE, PrometheusStatLogger
from myvllm.entrypoints.protocol import RequestError, error_body

logger = logging.getLogger("myvllm")

# /v1/completions without max_tokens: OpenAI's default. Chat without max_tokens may use
# the rest of the context, as vLLM does.
DEFAULT_COMPLETION_MAX_TOKENS = 16
# The largest request body read, unless make_server is told otherwise: room for a prompt of
# max_model_length tokens at 64 bytes each (a token's text escaped in JSON, or its id and a
# comma, is far less), and never under 1 MiB. A larger body gets a 413 before it is parsed.
MIN_BODY_LIMIT = 1 << 20
BODY_BYTES_PER_TOKEN = 64
DRAIN_LIMIT = 64 << 20  # the most of a too-large body read (and dropped) before the 413


def sse(data: dict[str, Any] | str) -> str:
    """One server-sent event."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def error_response(message: str, status: int, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, param), status_code=status)


def default_body_limit(max_model_length: int) -> int:
    return max(MIN_BODY_LIMIT, BODY_BYTES_PER_TOKEN * max_model_length)


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, or a 413 if it is larger than limit bytes. A too-large body is read
    to its end and dropped (up to DRAIN_LIMIT bytes), not kept: a client that sends its
    whole body before it reads the answer then gets the 413 rather than a broken pipe."""
    too_large = RequestError(f"the request body is larger than this server's limit of "
                             f"{limit} bytes", 413)
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > max(limit, DRAIN_LIMIT):
        raise too_large  # not worth reading; the connection is closed after the answer
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size <= limit:
                chunks.append(chunk)
            elif size > DRAIN_LIMIT:
                break
    except ClientDisconnect:  # nobody reads the answer; a client's doing, not a server error
        raise RequestError("the client closed the connection before the request body "
                           "was complete") from None
    if size > limit:
        raise too_large
    return b"".join(chunks)


async def _disconnected(request: Request) -> None:
    """Return when the client closes the connection (the body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def build_app(llm: AsyncLLM, model_name: str, stat_logger: PrometheusStatLogger,
              max_body_bytes: int | None = None) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        llm.start()  # read the core's outputs and watch its process from now on
        yield

    app = FastAPI(title="myvllm", docs_url=None, redoc_url=None, lifespan=lifespan)
    max_model_length = llm.max_model_length
    body_limit = (max_body_bytes if max_body_bytes is not None
                  else default_body_limit(max_model_length))
    created = int(time.time())

    @app.exception_handler(RequestError)
    async def _request_error(_: Request, e: RequestError) -> JSONResponse:
        return error_response(e.message, e.status, e.param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return error_response(str(e.detail), e.status_code)  # unknown route, wrong method

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(_: Request, e: EngineDeadError) -> JSONResponse:
        return error_response(str(e), 503)

    @app.exception_handler(Exception)
    async def _bug(_: Request, e: Exception) -> JSONResponse:
        # Not the client's fault: a bug here or in the engine. Logged with its traceback.
        logger.error("request failed", exc_info=e)
        return error_response(f"internal error: {type(e).__name__}: {e}", 500)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if llm.is_running else 503)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list",
                "data": [{"id": model_name, "object": "model", "created": created,
                          "owned_by": "myvllm", "max_model_len": max_model_length}]}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(stat_logger.render(), media_type=CONTENT_TYPE)

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise RequestError(f"The model `{name}` does not exist; this server serves "
                               f"`{model_name}`.", 404, "model")

    async def start(prompt_ids: list[int], params: Any, stop: list[str], request_id: str,
                    streamed: bool) -> tuple[StreamOutput, AsyncIterator[StreamOutput]]:
        """Queue the request and wait for its first output, so that the engine's refusal
        (ValueError / TypeError) is still a 400 and not an error inside a 200 stream."""
        outputs = llm.generate(prompt_ids, params, request_id, stop, streamed=streamed)
        try:
            first = await anext(outputs)
        except (ValueError, TypeError) as e:
            raise RequestError(str(e)) from e
        return first, outputs

    async def run(request: Request, body: Any, prompt_ids: list[int], default_max_tokens: int,
                  chat: bool) -> Response:
        check_model(body.model)
        try:
            params = body.sampling_params(default_max_tokens)
        except (ValueError, TypeError) as e:
            raise RequestError(str(e)) from e
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        if body.stream:
            first, outputs = await start(prompt_ids, params, body.stop_strings, request_id,
                                         streamed=True)
            events = (stream_chat if chat else stream_completion)(
                request_id, first, outputs, body.include_usage)
            return StreamingResponse(events, media_type="text/event-stream")
        # Not streamed: the answer is one body; watch the connection while it is computed.
        collect = asyncio.ensure_future(
            collect_text(prompt_ids, params, body.stop_strings, request_id))
        gone = asyncio.ensure_future(_disconnected(request))
        await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not collect.done():  # the client left: cancelling aborts the request
            collect.cancel()
            return Response(status_code=499)  # nobody reads it
        gone.cancel()
        text, reason, usage = collect.result()
        if reason == "abort":
            # Not the client's doing (its leaving cancels the task above): the server is
            # shutting down. A partial answer with a 200 would pass for a complete one.
            raise EngineDeadError("the server shut down before the answer was complete")
        if chat:
            return JSONResponse(protocol.chat_response(request_id, model_name, text, reason,
                                                       usage))
        return JSONResponse(protocol.completion_response(request_id, model_name, text, reason,
                                                         usage))

    async def collect_text(prompt_ids: list[int], params: Any, stop: list[str],
                           request_id: str) -> tuple[str, str | None, dict[str, int]]:
        # One body at the end: nobody reads the tokens as they come.
        first, outputs = await start(prompt_ids, params, stop, request_id, streamed=False)
        parts, last = [first.text or ""], first
        async for out in outputs:
            parts.append(out.text or "")
            last = out
        return ("".join(parts), last.finish_reason,
                protocol.usage(last.num_prompt_tokens, last.num_completion_tokens))

    async def stream_completion(request_id: str, first: StreamOutput,
                                outputs: AsyncIterator[StreamOutput],
                                include_usage: bool) -> AsyncIterator[str]:
        last = first
        try:
            async for out in _with_first(first, outputs):
                last = out
                if out.text or out.token_ids or out.finished:
                    yield sse(protocol.completion_response(
                        request_id, model_name, out.text or "", out.finish_reason, None))
        except EngineDeadError as e:
            yield sse(error_body(str(e), 503))
        if include_usage:
            chunk = protocol.completion_response(request_id, model_name, "", None, protocol.usage(
                last.num_prompt_tokens, last.num_completion_tokens))
            chunk["choices"] = []
            yield sse(chunk)
        yield sse("[DONE]")

    async def stream_chat(request_id: str, first: StreamOutput,
                          outputs: AsyncIterator[StreamOutput],
                          include_usage: bool) -> AsyncIterator[str]:
        yield sse(protocol.chat_chunk(request_id, model_name, {"role": "assistant",
                                                               "content": ""}))
        last = first
        try:
            async for out in _with_first(first, outputs):
                last = out
                if out.text or out.token_ids or out.finished:
                    yield from_output(request_id, out)
        except EngineDeadError as e:
            yield sse(error_body(str(e), 503))
        if include_usage:
            yield sse(protocol.chat_chunk(request_id, model_name, None, None, protocol.usage(
                last.num_prompt_tokens, last.num_completion_tokens)))
        yield sse("[DONE]")

    def from_output(request_id: str, out: StreamOutput) -> str:
        delta = {"content": out.text} if out.text else {}
        return sse(protocol.chat_chunk(request_id, model_name, delta, out.finish_reason))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = protocol.parse_request(protocol.CompletionRequest,
                                      await read_body(request, body_limit))
        prompt_ids = _encode(llm, body.prompt)
        return await run(request, body, prompt_ids, DEFAULT_COMPLETION_MAX_TOKENS, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = protocol.parse_request(protocol.ChatCompletionRequest,
                                      await read_body(request, body_limit))
        prompt_ids = apply_chat_template(llm, body)
        return await run(request, body, prompt_ids,
                         max(1, max_model_length - len(prompt_ids)), chat=True)

    return app


async def _with_first(first: StreamOutput,
                      outputs: AsyncIterator[StreamOutput]) -> AsyncIterator[StreamOutput]:
    try:
        yield first
        async for out in outputs:
            yield out
    finally:  # closed early (client gone): close generate() now, which aborts the request
        await outputs.aclose()  # type: ignore[attr-defined]


def _encode(llm: AsyncLLM, prompt: str | list[int]) -> list[int]:
    try:
        return llm.encode(prompt)
    except (ValueError, TypeError) as e:
        raise RequestError(str(e)) from e


def apply_chat_template(llm: AsyncLLM, body: protocol.ChatCompletionRequest) -> list[int]:
    """The conversation as the model was trained to read it, ending with the assistant's
    turn; tokenized without adding special tokens (the template writes them)."""
    tokenizer = llm.tokenizer
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise RequestError("this model has no chat template: use /v1/completions")
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    from jinja2 import TemplateError

    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=True,
                                             **(body.chat_template_kwargs or {}))
    except (TemplateError, ValueError, TypeError) as e:  # e.g. roles out of order
        raise RequestError(f"the chat template refused the messages: {e}") from e
    return list(tokenizer.encode(text, add_special_tokens=False))


# ---------------------------------------------------------------------------- running it
class Server(uvicorn.Server):
    """uvicorn, plus: a signal first aborts every request in flight (streams end at once, so
    the graceful shutdown does not wait for them), and the process then exits 0 instead of
    re-raising the signal. If the engine core process dies, the server stops too
    (core_died), so that its caller can exit non-zero and a supervisor start a new one."""

    def __init__(self, config: uvicorn.Config, llm: AsyncLLM,
                 exit_on_core_death: bool = True) -> None:
        super().__init__(config)
        self.llm = llm
        self.core_died = False
        self.exit_on_core_death = exit_on_core_death
        llm.on_core_death(self._on_core_death)

    def _on_core_death(self, error: BaseException) -> None:
        self.core_died = True
        if self.exit_on_core_death:
            logger.error(f"{error}: the server stops (exit code 1)")
            self.should_exit = True

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.llm.abort_all()
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield  # signals reach only the main thread (a server run in a thread, in tests)
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


def make_server(llm: AsyncLLM, model_name: str, host: str, port: int,
                log_level: str = "info", max_body_bytes: int | None = None,
                exit_on_core_death: bool = True) -> Server:
    """max_body_bytes: the largest request body taken (None: default_body_limit).
    exit_on_core_death False: the server keeps answering (503s) after the engine core
    died, instead of stopping (a server embedded in a process that decides for itself)."""
    stat_logger = PrometheusStatLogger(model_name)
    llm.stat_logger = stat_logger
    app = build_app(llm, model_name, stat_logger, max_body_bytes)
    # timeout_graceful_shutdown: a connection that still hangs after the aborts is cut.
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=3, access_log=False)
    return Server(config, llm, exit_on_core_death)
