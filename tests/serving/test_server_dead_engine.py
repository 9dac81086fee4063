"""The server over a dead engine: /health 503, new requests 503 with OpenAI's error JSON, and
requests in flight end with an error instead of hanging.

The server runs in a thread with exit_on_core_death off, so that the dead state can be looked
at (`myvllm serve` itself stops and exits 1: test_engine_core_faults.py).

    quick: the engine core process is SIGKILLed in the middle of a stream
    slow:  tensor_parallel_size 2 over gloo; rank 1 is SIGKILLed while a stream is running,
           then a second server's worker is killed while it is idle (the watchdog alone): the
           core reports the death and exits; and the core process stopped (SIGSTOP) in the
           middle of a stream: its heartbeat stops, and the front end takes it for dead (this
           server with exit_on_core_death on, to see it stop as `myvllm serve` does)
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("openai")  # test_server's module imports it

from helpers_models import tiny_checkpoint  # noqa: E402
from test_cli import engine_children  # noqa: E402
from test_server import fetch, free_socket, served_in_thread  # noqa: E402

from myvllm import Config  # noqa: E402
from myvllm.serving.async_llm import AsyncLLM  # noqa: E402
from myvllm.entrypoints.openai_server import make_server  # noqa: E402

HANG_LIMIT_S = 30.0  # a request still open this long after the death counts as hung
ENGINE_KW: dict[str, Any] = dict(num_kvcache_blocks=128, max_model_length=256,
                                 max_num_batched_tokens=256)


@pytest.fixture(scope="module")
def checkpoint() -> Path:
    return tiny_checkpoint("qwen3")  # a byte-level tokenizer: text prompts work


@contextlib.contextmanager
def serving(config: Config) -> Iterator[tuple[str, AsyncLLM]]:
    llm = AsyncLLM(config)
    with served_in_thread(llm, "tiny", HANG_LIMIT_S, log_level="critical",
                          exit_on_core_death=False) as url:
        yield url, llm


def completion(base_url: str, stream: bool = False, max_tokens: int = 8) -> tuple[int, bytes]:
    body = {"model": "tiny", "prompt": "Tell me about the number 7", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": stream}
    return fetch("POST", f"{base_url}/v1/completions", json.dumps(body).encode())


def assert_refused(base_url: str, match: str) -> None:
    """/health and a new completion answer 503; the body is OpenAI's error JSON."""
    assert fetch("GET", f"{base_url}/health")[0] == 503
    status, body = completion(base_url)
    assert status == 503, body
    error = json.loads(body)["error"]
    assert error["code"] == 503 and match in error["message"], error


def open_stream(base_url: str, max_tokens: int) -> tuple[http.client.HTTPConnection, Any]:
    """Start a streamed completion; (connection, response) once its first event arrived."""
    host, port = base_url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=HANG_LIMIT_S)
    body = {"model": "tiny", "prompt": "Count to a thousand", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(body),
                 {"content-type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    assert response.readline().startswith(b"data: {")
    return conn, response


def rest_of_stream(response: Any) -> list[dict[str, Any]]:
    """The remaining events up to [DONE]; a socket timeout (HANG_LIMIT_S) fails the test."""
    events = []
    for line in iter(response.readline, b""):
        if line.startswith(b"data: "):
            data = line[len(b"data: "):].strip()
            if data == b"[DONE]":
                return events
            events.append(json.loads(data))
    raise AssertionError("the stream closed without [DONE]")


@pytest.mark.slow  # ~11 s here
def test_engine_core_killed_mid_request(checkpoint: Path) -> None:
    with serving(Config(model=str(checkpoint), **ENGINE_KW)) as (base_url, llm):
        assert fetch("GET", f"{base_url}/health")[0] == 200
        conn, stream = open_stream(base_url, max_tokens=200)
        plain: list[tuple[int, bytes]] = []
        waiting = threading.Thread(target=lambda: plain.append(completion(base_url, False, 200)))
        waiting.start()
        time.sleep(0.2)  # queued or decoding
        assert llm.core_pid is not None
        os.kill(llm.core_pid, signal.SIGKILL)
        events = rest_of_stream(stream)
        conn.close()
        assert "error" in events[-1], f"the stream ended without the error: {events[-1]}"
        assert "engine core process died (killed by SIGKILL)" in events[-1]["error"]["message"]
        assert events[-1]["error"]["code"] == 503
        waiting.join(HANG_LIMIT_S)
        assert not waiting.is_alive(), "a request in flight was left hanging"
        assert plain[0][0] == 503, plain
        assert not llm.is_running
        assert_refused(base_url, "engine core process died")


def worker_of(llm: AsyncLLM) -> int:
    """The pid of the core's tensor-parallel worker (rank 1)."""
    assert llm.core_pid is not None
    (worker,) = engine_children(llm.core_pid)
    return worker


@pytest.mark.slow
def test_tensor_parallel_worker_killed(checkpoint: Path) -> None:
    config = Config(model=str(checkpoint), tensor_parallel_size=2, **ENGINE_KW)
    # During a stream: the step fails, the stream ends with the error.
    with serving(config) as (base_url, llm):
        conn, stream = open_stream(base_url, max_tokens=200)
        os.kill(worker_of(llm), signal.SIGKILL)
        events = rest_of_stream(stream)
        conn.close()
        assert "error" in events[-1], f"the stream ended without the error: {events[-1]}"
        assert "rank 1 died (killed by SIGKILL" in events[-1]["error"]["message"]
        assert_refused(base_url, "rank 1 died (killed by SIGKILL")

    # While idle: no request needed, the watchdog turns /health to 503.
    with serving(config) as (base_url, llm):
        assert fetch("GET", f"{base_url}/health")[0] == 200
        os.kill(worker_of(llm), signal.SIGKILL)
        deadline = time.monotonic() + HANG_LIMIT_S
        while fetch("GET", f"{base_url}/health")[0] != 503:
            assert time.monotonic() < deadline, "/health still 200 after the worker died"
            time.sleep(0.05)
        assert_refused(base_url, "rank 1 died (killed by SIGKILL")


@pytest.mark.slow  # ~10 s: a server started and shut down mid-answer
def test_a_whole_answer_cut_by_shutdown_is_a_503(checkpoint: Path) -> None:
    """A request with stream false that the server's shutdown aborts gets a 503, not a 200
    with part of the text and finish_reason "abort" (which a client that reads only the
    status would take for a whole answer)."""
    with serving(Config(model=str(checkpoint), **ENGINE_KW)) as (base_url, llm):
        answers: list[tuple[int, bytes]] = []
        waiting = threading.Thread(target=lambda: answers.append(completion(base_url, False,
                                                                            200)))
        waiting.start()
        deadline = time.monotonic() + HANG_LIMIT_S
        while not llm._by_request_id:  # the request is in the engine
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.01)
        llm.abort_all()  # what a SIGTERM to the server does first
        waiting.join(HANG_LIMIT_S)
        status, body = answers[0]
        assert status == 503, body
        assert "shut down before the answer was complete" in json.loads(body)["error"]["message"]


@pytest.mark.slow
def test_engine_core_that_stops_answering_is_taken_for_dead(checkpoint: Path) -> None:
    """The core process alive but stopped (SIGSTOP, as a core stuck in C code holding the
    interpreter): its heartbeat stops, and after hang_timeout_s the requests in flight fail
    with a 503, /health answers 503, the server stops as on the core's death (`myvllm
    serve` then exits 1), and shutdown() kills the stopped core within seconds."""
    hang_timeout_s = 3.0
    llm = AsyncLLM(Config(model=str(checkpoint), **ENGINE_KW), hang_timeout_s=hang_timeout_s)
    core = llm.core_pid
    assert core is not None
    sock = free_socket()
    server = make_server(llm, "tiny", "127.0.0.1", sock.getsockname()[1], log_level="critical")
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    base_url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        while not server.started:
            assert thread.is_alive(), "the server thread died while starting"
            time.sleep(0.05)
        conn, stream = open_stream(base_url, max_tokens=200)
        plain: list[tuple[int, bytes]] = []
        waiting = threading.Thread(target=lambda: plain.append(completion(base_url, False, 200)))
        waiting.start()
        time.sleep(0.2)  # queued or decoding
        os.kill(core, signal.SIGSTOP)
        stopped_at = time.monotonic()
        events = rest_of_stream(stream)
        noticed = time.monotonic() - stopped_at
        conn.close()
        assert "error" in events[-1], f"the stream ended without the error: {events[-1]}"
        assert "stopped answering" in events[-1]["error"]["message"], events[-1]
        assert events[-1]["error"]["code"] == 503
        assert hang_timeout_s <= noticed < hang_timeout_s + 5, noticed
        waiting.join(HANG_LIMIT_S)
        assert plain and plain[0][0] == 503, plain
        assert server.core_died  # what makes `myvllm serve` exit 1
        thread.join(HANG_LIMIT_S)  # the server stops by itself
        assert not thread.is_alive(), "the server did not stop"
        started = time.monotonic()
        llm.shutdown()
        assert time.monotonic() - started < 10, "shutdown() waited on the stopped core"
        assert llm._process.exitcode == -signal.SIGKILL
    finally:
        if llm._process.is_alive():
            os.kill(core, signal.SIGCONT)
        server.should_exit = True
        thread.join(HANG_LIMIT_S)
        llm.shutdown()
        sock.close()
