"""The OpenAI-compatible HTTP server: FastAPI routes over an AsyncLLM (or a DPAsyncLLM:
data-parallel replicas behind one router; both are EngineClients).

    GET  /health               200 while the engine accepts requests, else 503 (text/plain)
    GET  /ping                 the same as /health (vLLM's route; POST too)
    GET  /version              {"version": myvllm's version}
    GET  /v1/models            the one model served
    GET  /v1/models/{id}       its card, or a 404 naming the model served
    POST /v1/completions       prompt (text, token ids, or a batch of either) -> text
    POST /v1/chat/completions  messages -> the tokenizer's chat template -> text
    POST /tokenize             prompt or messages -> token ids (vLLM's route)
    POST /detokenize           token ids -> text (vLLM's route)
    GET  /metrics              Prometheus text (see metrics.py)

With an API key (make_server's api_key), every route but /health, /ping, /metrics and /version
answers 401 without `Authorization: Bearer KEY` (api_key.py).

A request's way through this file (generating: serving_completion.py; the engine side:
myvllm/serving/async_llm.py):

    body bytes (a 413 over the size limit, a 408 if they stall)
      --parse_request--> a request model of protocol.py (strict; a mistake is a 400)
      -> token ids -> Generation (serving_completion.py) -> JSON body or server-sent events

Client mistakes never reach the engine loop as exceptions: the body is validated here, the
prompts are checked against the context and the vocabulary before anything is queued, and the
engine's own refusals (ValueError/TypeError from generate(), before any output) become 400s
with OpenAI's error JSON. Every request gets one log line (request_log.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import logging
import signal
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from types import FrameType
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from myvllm.serving.async_llm import EngineDeadError
from myvllm.serving.engine_client import EngineClient
from myvllm.engine.request_checks import check_token_ids
from myvllm.entrypoints import protocol
from myvllm.entrypoints.safeguards.api_key import ApiKeyMiddleware
from myvllm.entrypoints.chat_output_parsing import ChatOutputSettings, output_parsing
from myvllm.entrypoints.event_loop import serving_loop_name
from myvllm.entrypoints.safeguards.h11_deadlines import (DEFAULT_TIMEOUT_REQUEST_HEAD_S,
                                                         DeadlineConfig)
from myvllm.entrypoints.metrics import CONTENT_TYPE, PrometheusStatLogger
from myvllm.entrypoints.protocol import RequestError, error_body
from myvllm.entrypoints.request_log import RequestLogMiddleware, request_log
from myvllm.entrypoints.request_log import logger as request_logger
from myvllm.entrypoints.responses import model_card
from myvllm.entrypoints.safeguards.connection_limits import (check_max_connections,
                                                             default_max_connections,
                                                             raise_open_file_limit)
from myvllm.entrypoints.safeguards.log_rate_limit import rate_limit_server_logs
from myvllm.entrypoints.safeguards.server_limits import DEFAULT_TIMEOUT_REQUEST_BODY_S, ServerLimits
from myvllm.entrypoints.serving_completion import Generation
from myvllm.utils.chat_template import NoChatTemplateError, chat_prompt_ids
from myvllm.utils.gc_freeze import frozen_heap

logger = logging.getLogger("myvllm")


def installed_version() -> str:
    """/version's answer: the installed package's version, or "unknown (run from source)"
    where src/ is on PYTHONPATH with no installed metadata (how the GPU machine runs it)."""
    try:
        return importlib.metadata.version("myvllm")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (run from source)"


myvllm_version = installed_version()

# The largest request body read, unless make_server is told otherwise: room for a prompt of
# max_model_length tokens at 64 bytes each (a token's text escaped in JSON, or its id and a
# comma, is far less), and never under 1 MiB. A larger body gets a 413 before it is parsed.
MIN_BODY_LIMIT = 1 << 20
BODY_BYTES_PER_TOKEN = 64
DRAIN_LIMIT = 64 << 20  # the most of a too-large body read (and dropped) before the 413
# A body that sends nothing for this long is given up (408): a client that stalls in the
# middle of its body would otherwise hold its connection and this task for good.
BODY_IDLE_TIMEOUT_S = 30.0
# A kept-alive connection idle this long after an answer is closed (uvicorn's and vLLM's
# default: clients that reuse connections send their next request within it).
TIMEOUT_KEEP_ALIVE_S = 5
# The largest request line and headers taken (h11's default, made explicit): a head is a few
# hundred bytes from any API client; a larger one is a 400 before it is complete.
MAX_REQUEST_HEAD_BYTES = 16 * 1024
# The request body of each POST route, declared in the OpenAPI schema (the routes parse the
# raw bytes themselves, for the size limit and strict types, so FastAPI cannot see them).
BODY_MODELS: dict[str, list[type[protocol.RequestBody]]] = {
    "/v1/completions": [protocol.CompletionRequest],
    "/v1/chat/completions": [protocol.ChatCompletionRequest],
    "/tokenize": [protocol.TokenizeCompletionRequest, protocol.TokenizeChatRequest],
    "/detokenize": [protocol.DetokenizeRequest],
}


def error_response(message: str, status: int, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, param), status_code=status)


def default_body_limit(max_model_length: int) -> int:
    return max(MIN_BODY_LIMIT, BODY_BYTES_PER_TOKEN * max_model_length)


async def read_body(request: Request, limit: int,
                    timeout_s: float = DEFAULT_TIMEOUT_REQUEST_BODY_S) -> bytes:
    """The request body, or a 413 if it is larger than limit bytes. A too-large body is read
    to its end and dropped (up to DRAIN_LIMIT bytes), not kept: a client that sends its
    whole body before it reads the answer then gets the 413 rather than a broken pipe.
    The whole body must come within timeout_s (a byte now and then does not keep the
    connection), and no silence may last BODY_IDLE_TIMEOUT_S: else a 408."""
    too_large = RequestError(f"the request body is larger than this server's limit of "
                             f"{limit} bytes", 413)
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > max(limit, DRAIN_LIMIT):
        raise too_large  # not worth reading; the connection is closed after the answer
    chunks, size = [], 0
    stream = request.stream()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    try:
        while True:
            wait_s = min(BODY_IDLE_TIMEOUT_S, deadline - loop.time())
            try:
                chunk = await asyncio.wait_for(anext(stream), max(wait_s, 0.0))
            except StopAsyncIteration:
                break
            size += len(chunk)
            if size <= limit:
                chunks.append(chunk)
            elif size > DRAIN_LIMIT:
                break
    except ClientDisconnect:  # nobody reads the answer; a client's doing, not a server error
        raise RequestError("the client closed the connection before the request body "
                           "was complete") from None
    except asyncio.TimeoutError:
        if loop.time() >= deadline:
            raise RequestError(f"the request body did not arrive within {timeout_s:g} s "
                               f"({size} bytes came; --timeout-request-body)", 408) from None
        raise RequestError(f"the request body stalled: nothing came for "
                           f"{BODY_IDLE_TIMEOUT_S:g} s", 408) from None
    if size > limit:
        raise too_large
    return b"".join(chunks)


def build_app(llm: EngineClient, model_name: str, stat_logger: PrometheusStatLogger,
              max_body_bytes: int | None = None, api_key: str | None = None,
              chat_template: str | None = None,
              chat_outputs: ChatOutputSettings | None = None,
              limits: ServerLimits | None = None) -> FastAPI:
    """api_key: the bearer token every route but the open ones asks for (None: none asked).
    chat_template: a Jinja template for chat requests instead of the tokenizer's (None: the
    tokenizer's). chat_outputs: how chat answers are read (reasoning, tool calls: the
    --reasoning-parser, --enable-auto-tool-choice and --tool-call-parser flags). limits:
    what one request or client may take (None: the defaults)."""
    limits = limits or ServerLimits()
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        llm.start()  # read the core's outputs and watch its process from now on
        # What start-up made (the libraries, the app, the routes' schemas) lives as long as
        # the server: no full garbage collection walks it between two streamed tokens.
        with frozen_heap():
            yield

    app = FastAPI(title="myvllm", docs_url=None, redoc_url=None, lifespan=lifespan)
    if api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    app.add_middleware(RequestLogMiddleware)  # added last, so outermost: it logs the 401s too
    max_model_length = llm.max_model_length
    body_limit = (max_body_bytes if max_body_bytes is not None
                  else default_body_limit(max_model_length))
    created = int(time.time())
    generation = Generation(llm, model_name, limits.max_response_bytes)
    body_timeout_s = limits.timeout_request_body_s

    def refused(request: Request, message: str, status: int,
                param: str | None = None) -> JSONResponse:
        request_log(request).reason = message
        return error_response(message, status, param)

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, e: RequestError) -> JSONResponse:
        return refused(request, e.message, e.status, e.param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        return refused(request, str(e.detail), e.status_code)  # unknown route, wrong method

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(request: Request, e: EngineDeadError) -> JSONResponse:
        return refused(request, str(e), 503)

    @app.exception_handler(Exception)
    async def _bug(_: Request, e: Exception) -> JSONResponse:
        # Not the client's fault: a bug here or in the engine. Logged with its traceback.
        logger.error("request failed", exc_info=e)
        return error_response(f"internal error: {type(e).__name__}: {e}", 500)

    @app.get("/health")
    async def health() -> Response:
        if llm.is_running:
            return PlainTextResponse("ok\n")
        return PlainTextResponse("the engine is not running\n", status_code=503)

    @app.get("/ping")  # vLLM's (and SageMaker's) health probe
    async def ping() -> Response:
        return await health()

    @app.post("/ping", include_in_schema=False)  # vLLM takes POST too; it has no body
    async def ping_post() -> Response:
        return await health()

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": myvllm_version}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card(model_name, created, max_model_length)]}

    @app.get("/v1/models/{model_id:path}")  # :path: hub ids hold a slash (Qwen/Qwen3-0.6B)
    async def model(model_id: str) -> dict[str, Any]:
        check_model(model_id)
        return model_card(model_name, created, max_model_length)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(stat_logger.render(), media_type=CONTENT_TYPE)

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise RequestError(f"The model `{name}` does not exist; this server serves "
                               f"`{model_name}`.", 404, "model")

    async def parse(request: Request, model: type[protocol.RequestBody]) -> Any:
        body = protocol.parse_request(model, await read_body(request, body_limit,
                                                             body_timeout_s))
        check_model(body.model)
        return body

    @app.post("/v1/completions", openapi_extra=_body_schema("/v1/completions"))
    async def completions(request: Request) -> Response:
        body = await parse(request, protocol.CompletionRequest)
        return await generation.completions(request, body)

    @app.post("/v1/chat/completions", openapi_extra=_body_schema("/v1/chat/completions"))
    async def chat_completions(request: Request) -> Response:
        body = await parse(request, protocol.ChatCompletionRequest)
        parsing = output_parsing(body, chat_outputs, llm.tokenizer)
        return await generation.chat(request, body,
                                     apply_chat_template(llm, body, chat_template), parsing)

    @app.post("/tokenize", openapi_extra=_body_schema("/tokenize"))
    async def tokenize(request: Request) -> dict[str, Any]:
        body = protocol.parse_tokenize_request(await read_body(request, body_limit,
                                                               body_timeout_s))
        check_model(body.model)
        if isinstance(body, protocol.TokenizeChatRequest):
            tokens = apply_chat_template(llm, body, chat_template)
        else:
            tokens = list(need_tokenizer(llm).encode(
                body.prompt, add_special_tokens=body.add_special_tokens))
        request_log(request).prompt_tokens = len(tokens)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": max_model_length}

    @app.post("/detokenize", openapi_extra=_body_schema("/detokenize"))
    async def detokenize(request: Request) -> dict[str, Any]:
        body = await parse(request, protocol.DetokenizeRequest)
        try:
            tokens = check_token_ids(body.tokens, llm.vocab_size)
        except (ValueError, TypeError) as e:
            raise RequestError(str(e), param="tokens") from e
        return {"prompt": need_tokenizer(llm).decode(tokens)}

    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]  # FastAPI's hook
    return app


def _body_schema(path: str) -> dict[str, Any]:
    """A route's request body in the OpenAPI schema: its models, in components/schemas."""
    refs = [{"$ref": f"#/components/schemas/{m.__name__}"} for m in BODY_MODELS[path]]
    schema = refs[0] if len(refs) == 1 else {"anyOf": refs}
    return {"requestBody": {"required": True,
                            "content": {"application/json": {"schema": schema}}}}


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema, plus the request body models (and the models they nest)."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for models in BODY_MODELS.values():
            for model in models:
                body = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(body.pop("$defs", {}))
                components[model.__name__] = body
        app.openapi_schema = schema
    return app.openapi_schema


def need_tokenizer(llm: EngineClient) -> Any:
    if llm.tokenizer is None:
        raise RequestError("this model has no tokenizer: prompts are token ids")
    return llm.tokenizer


def apply_chat_template(llm: EngineClient, body: protocol.ChatCompletionRequest
                        | protocol.TokenizeChatRequest, chat_template: str | None = None
                        ) -> list[int]:
    """The conversation as the model was trained to read it (by default ending with the
    assistant's turn opened). chat_template: the server's --chat-template, used instead of
    the tokenizer's own."""
    messages = [m.for_template() for m in body.messages]
    from jinja2 import TemplateError

    try:
        return chat_prompt_ids(llm.tokenizer, messages,
                               add_generation_prompt=body.add_generation_prompt,
                               chat_template=chat_template,
                               template_kwargs=body.chat_template_kwargs,
                               tools=body.template_tools())
    except NoChatTemplateError:
        raise RequestError("this model has no chat template: use /v1/completions") from None
    except (TemplateError, ValueError, TypeError) as e:  # e.g. roles out of order
        raise RequestError(f"the chat template refused the messages: {e}") from e


# ---------------------------------------------------------------------------- running it
class Server(uvicorn.Server):
    """uvicorn, plus: a signal first aborts every request in flight (streams end at once, so
    the graceful shutdown does not wait for them), and the process then exits 0 instead of
    re-raising the signal. If the engine core process dies, the server stops too
    (core_died), so that its caller can exit non-zero and a supervisor start a new one."""

    def __init__(self, config: uvicorn.Config, llm: EngineClient,
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

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        loop = type(asyncio.get_running_loop())
        name = "uvloop" if loop.__module__.startswith("uvloop") else "asyncio"
        logger.info(f"event loop: {name} ({loop.__module__}.{loop.__qualname__})")
        await super().serve(sockets)

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


def make_server(llm: EngineClient, model_name: str, host: str, port: int,
                log_level: str = "info", max_body_bytes: int | None = None,
                exit_on_core_death: bool = True,
                timeout_request_head: float = DEFAULT_TIMEOUT_REQUEST_HEAD_S,
                api_key: str | None = None, chat_template: str | None = None,
                chat_outputs: ChatOutputSettings | None = None,
                limits: ServerLimits | None = None) -> Server:
    """max_body_bytes: the largest request body taken (None: default_body_limit).
    exit_on_core_death False: the server keeps answering (503s) after the engine core
    died, instead of stopping (a server embedded in a process that decides for itself).
    log_level: uvicorn's, and the request log's (one INFO line per request).
    timeout_request_head: seconds a connection has to send a whole request head
    (h11_deadlines.py). api_key, chat_template, chat_outputs, limits: as build_app."""
    stat_logger = PrometheusStatLogger(model_name)
    llm.stat_logger = stat_logger
    if chat_outputs is not None:
        chat_outputs.check()
    limits = limits or ServerLimits()
    # Connections are bounded below the open-file limit (connection_limits.py).
    open_file_limit = raise_open_file_limit()
    max_connections = limits.max_connections or default_max_connections(open_file_limit)
    check_max_connections(max_connections, open_file_limit)
    app = build_app(llm, model_name, stat_logger, max_body_bytes, api_key, chat_template,
                    chat_outputs, limits)
    request_logger.setLevel(log_level.upper())
    rate_limit_server_logs()
    return Server(uvicorn_config(app, host, port, log_level, timeout_request_head,
                                 max_connections), llm, exit_on_core_death)


def uvicorn_config(app: Any, host: str, port: int, log_level: str,
                   timeout_request_head: float = DEFAULT_TIMEOUT_REQUEST_HEAD_S,
                   max_connections: int | None = None) -> DeadlineConfig:
    """How make_server runs uvicorn. timeout_graceful_shutdown: a connection that still
    hangs after the aborts is cut. access_log off: the request log (request_log.py) writes
    the line, with more in it. max_connections: past it a connection gets a quick 503.
    loop: uvloop where it is installed (event_loop.py)."""
    return DeadlineConfig(app, timeout_request_head=timeout_request_head,
                          loop=serving_loop_name(), max_connections=max_connections, host=host,
                          port=port, log_level=log_level, timeout_graceful_shutdown=3,
                          access_log=False, timeout_keep_alive=TIMEOUT_KEEP_ALIVE_S,
                          h11_max_incomplete_event_size=MAX_REQUEST_HEAD_BYTES)
