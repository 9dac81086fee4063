"""The server's event loop: uvloop where it can be imported, asyncio's loop where it cannot
(Windows, or a machine without it), with no error; the start-up log names it."""

from __future__ import annotations

import asyncio
import logging
import socket
import sys
import types
from typing import Any

import pytest

from myvllm.entrypoints.event_loop import serving_loop_factory, serving_loop_name
from myvllm.entrypoints.openai_server import Server, uvicorn_config


def fake_uvloop() -> types.ModuleType:
    module = types.ModuleType("uvloop")
    module.new_event_loop = asyncio.new_event_loop  # type: ignore[attr-defined]
    return module


def test_uvloop_is_picked_where_it_imports(monkeypatch: pytest.MonkeyPatch) -> None:
    uvloop = fake_uvloop()
    monkeypatch.setitem(sys.modules, "uvloop", uvloop)
    assert serving_loop_name() == "uvloop"
    assert serving_loop_factory() is uvloop.new_event_loop
    assert uvicorn_config(None, "127.0.0.1", 8000, "info").loop == "uvloop"


def test_asyncio_loop_where_uvloop_does_not_import(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # None: `import uvloop` raises ImportError
    assert serving_loop_name() == "asyncio"
    assert serving_loop_factory() is asyncio.new_event_loop
    config = uvicorn_config(None, "127.0.0.1", 8000, "info")
    assert config.loop == "asyncio"
    loop = config.get_loop_factory()()  # uvicorn makes it
    try:
        assert isinstance(loop, asyncio.AbstractEventLoop)
        assert not type(loop).__module__.startswith("uvloop")
    finally:
        loop.close()


def test_the_real_uvloop_serves_where_installed() -> None:
    uvloop = pytest.importorskip("uvloop")
    loop = uvicorn_config(None, "127.0.0.1", 8000, "info").get_loop_factory()()
    try:
        assert isinstance(loop, uvloop.Loop)
    finally:
        loop.close()


class NoEngine:
    """What Server asks of an engine client before any request."""

    def on_core_death(self, callback: Any) -> None:
        pass

    def abort_all(self) -> None:
        pass


def test_the_start_up_log_names_the_loop(caplog: pytest.LogCaptureFixture) -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        pass  # never called: the server stops before any request

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = Server(uvicorn_config(app, "127.0.0.1", sock.getsockname()[1], "warning"),
                    NoEngine(), exit_on_core_death=False)
    server.should_exit = True  # start, then stop at once
    loop = asyncio.new_event_loop()
    try:
        with caplog.at_level(logging.INFO, logger="myvllm"):
            loop.run_until_complete(server.serve(sockets=[sock]))
    finally:
        loop.close()
        sock.close()
    assert "event loop: asyncio (" in caplog.text
