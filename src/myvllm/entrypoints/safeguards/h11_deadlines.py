"""Deadlines for slow or idle clients, on top of uvicorn's h11 protocol.

uvicorn closes a kept-alive connection that stays idle timeout_keep_alive seconds after an
answer, but a connection that never sends a byte, or stops in the middle of its request
line and headers, is held open for good: the keep-alive timer is armed only after an
answer, and the first byte received cancels it. A client can so hold any number of
connections (and their file descriptors) for free. Here a request's head must be complete
within timeout_request_head seconds, counted from the connection's start and again from the
end of each answer; otherwise the connection is closed. h11_max_incomplete_event_size (set
in make_server) bounds what such a half-sent head may hold in memory meanwhile.

The same protocol refuses a connection past max_connections with a quick 503
(connection_limits.py).
"""

from __future__ import annotations

import asyncio
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from myvllm.entrypoints.safeguards.connection_limits import refuse_connection

DEFAULT_TIMEOUT_REQUEST_HEAD_S = 20.0


class DeadlineConfig(uvicorn.Config):
    """uvicorn's Config, serving HTTP with H11WithHeadDeadline."""

    def __init__(self, app: Any, timeout_request_head: float = DEFAULT_TIMEOUT_REQUEST_HEAD_S,
                 max_connections: int | None = None, **kwargs: Any) -> None:
        super().__init__(app, http=H11WithHeadDeadline, **kwargs)
        self.timeout_request_head = timeout_request_head
        self.max_connections = max_connections  # None: no limit


class H11WithHeadDeadline(H11Protocol):
    """uvicorn's h11 protocol; a connection whose request head is not complete in time is
    closed (no answer: there is no request to answer yet)."""

    def __init__(self, config: uvicorn.Config, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        self.timeout_request_head = getattr(config, "timeout_request_head",
                                            DEFAULT_TIMEOUT_REQUEST_HEAD_S)
        self._head_timer: asyncio.TimerHandle | None = None
        self.max_connections: int | None = getattr(config, "max_connections", None)
        self._refused = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        # (The base class narrows asyncio.Protocol's BaseTransport parameter the same way.)
        if (self.max_connections is not None
                and len(self.connections) >= self.max_connections):
            self._refused = True  # never one of the server's connections
            refuse_connection(transport, self.loop, self.max_connections)
            return
        super().connection_made(transport)
        self._arm_head_timer()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # dropped: the 503 is sent
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # a whole head arrived: a request runs
            self._cancel_head_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self._arm_head_timer()  # the next request's head, on a kept-alive connection

    def connection_lost(self, exc: Exception | None) -> None:
        if self._refused:
            return
        self._cancel_head_timer()
        super().connection_lost(exc)

    def _arm_head_timer(self) -> None:
        self._cancel_head_timer()
        self._head_timer = self.loop.call_later(self.timeout_request_head, self._head_late)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_late(self) -> None:
        self._head_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()
