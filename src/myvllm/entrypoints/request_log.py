"""One log line per HTTP request, on the `myvllm.requests` logger, when its answer is complete
(a stream's at its end), in uvicorn's access-log format plus what the route reports:

    127.0.0.1:50312 - "POST /v1/completions HTTP/1.1" 200 prompt_tokens=5 completion_tokens=9 0.412s
    127.0.0.1:50313 - "POST /v1/completions HTTP/1.1" 400 0.003s: not supported yet: logit_bias ...

uvicorn's own access log is off (make_server): it writes its line when the response starts,
before a stream's tokens are known, and knows nothing of refusals' reasons. The logger is a
child of `myvllm`, so the lines go to its handler; make_server sets its level from
log_level, so that "warning" (as the tests run servers) keeps them out.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from myvllm.entrypoints.safeguards.log_rate_limit import LogRateLimiter, with_count

logger = logging.getLogger("myvllm.requests")

SCOPE_KEY = "myvllm.request_log"
# Refusals (4xx, 5xx) of one status: at most this many lines per 10 s, then one with a
# count (log_rate_limit.py): a flood of bad requests writes a few lines, not one each.
REFUSAL_LINES_PER_INTERVAL = 100


@dataclass
class RequestLog:
    """What a route tells the log line about its request."""

    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    reason: str | None = None  # why it was refused, failed or cut short


def request_log(request: Request) -> RequestLog:
    """The log entry of this request (a fresh one outside RequestLogMiddleware)."""
    entry: RequestLog = request.scope.setdefault(SCOPE_KEY, RequestLog())
    return entry


class RequestLogMiddleware:
    """Plain ASGI, not Starlette's BaseHTTPMiddleware: that one runs the route in a task of
    its own and wraps receive(), which would come between a stream and its client's
    disconnect."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.refusals = LogRateLimiter(burst=REFUSAL_LINES_PER_INTERVAL)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.monotonic()
        entry = scope[SCOPE_KEY] = RequestLog()
        status = 0

        async def watched_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, watched_send)
        except BaseException as e:  # a bug: the outer error handler answers 500
            status = status or 500
            entry.reason = entry.reason or f"{type(e).__name__}: {e}"
            raise
        finally:
            if logger.isEnabledFor(logging.INFO):
                left_out = self.refusals.admit(status) if status >= 400 else 0
                if left_out is not None:
                    logger.info(with_count(log_line(scope, status, entry,
                                                    time.monotonic() - start), left_out))


def log_line(scope: Scope, status: int, entry: RequestLog, seconds: float) -> str:
    client: Any = scope.get("client")
    where = f"{client[0]}:{client[1]}" if client else "-"
    path = scope["path"] + (f"?{scope['query_string'].decode('latin-1')}"
                            if scope.get("query_string") else "")
    line = f'{where} - "{scope["method"]} {path} HTTP/{scope["http_version"]}" {status}'
    if entry.prompt_tokens is not None:
        line += f" prompt_tokens={entry.prompt_tokens}"
    if entry.completion_tokens is not None:
        line += f" completion_tokens={entry.completion_tokens}"
    line += f" {seconds:.3f}s"
    if entry.reason:
        line += f": {entry.reason}"
    return line
