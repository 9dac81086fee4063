"""`myvllm serve --api-key KEY`: every route but the open ones answers 401 without the header
`Authorization: Bearer KEY` (what the openai client sends for its api_key).

The probes stay open, so that a load balancer or a Prometheus scraper needs no key:
/health, /ping, /metrics and /version. Plain ASGI, as RequestLogMiddleware (request_log.py
says why), and added only when a key is set: a server without one runs none of this.
"""

from __future__ import annotations

import hmac
import json

from starlette.types import ASGIApp, Receive, Scope, Send

from myvllm.entrypoints.protocol import error_body
from myvllm.entrypoints.request_log import SCOPE_KEY, RequestLog

OPEN_PATHS = frozenset({"/health", "/ping", "/metrics", "/version"})


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] != "http" or scope["path"] in OPEN_PATHS
                or scope["method"] == "OPTIONS" or self._authorized(scope)):
            await self.app(scope, receive, send)
            return
        message = ("a valid API key is needed: send the header 'Authorization: Bearer KEY' "
                   "(the openai client's api_key)")
        scope.setdefault(SCOPE_KEY, RequestLog()).reason = "no valid API key"
        body = json.dumps(error_body(message, 401)).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})

    def _authorized(self, scope: Scope) -> bool:
        given = next((value for name, value in scope["headers"] if name == b"authorization"),
                     b"")
        return hmac.compare_digest(given, self.expected)  # in constant time
