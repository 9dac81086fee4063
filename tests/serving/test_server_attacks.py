"""Attacks on a served engine that one client can make with valid requests, and the bounds
that answer them (entrypoints/safeguards/server_limits.py; docs/reliability.md, "One request or client
cannot take the server down").

One server for the module: the tiny random Qwen3 of test_server.py with room for 1,024
positions, uvicorn in a thread, limits lowered so that each attack is quick:
- an answer over max_response_bytes (n x echo x logprobs) is a 400 that gives its estimated
  size and the bound, before anything is queued; one just under the bound is served, and
  /health keeps answering meanwhile (it used to wait for the whole answer to be built);
- connections past max_connections get a 503 at once, and the server serves on;
- a body trickled a byte at a time gets a 408 when its total time is up;
- a flood of bad requests writes a bounded number of log lines.
"""

from __future__ import annotations

import contextlib
import json
import logging
import resource
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("openai")

from test_server import MODEL, fetch, metrics, served_in_thread, tiny_chat_checkpoint, wait_for  # noqa: E402

from myvllm import Config  # noqa: E402
from myvllm.entrypoints.safeguards.log_rate_limit import (SERVER_LOG_BURST, LogRateLimiter,  # noqa: E402
                                               with_count)
from myvllm.entrypoints.request_log import REFUSAL_LINES_PER_INTERVAL  # noqa: E402
from myvllm.entrypoints.safeguards.response_bounds import estimate_response_bytes  # noqa: E402
from myvllm.entrypoints.safeguards.server_limits import ServerLimits  # noqa: E402
from myvllm.sampling_parameters import SamplingParams  # noqa: E402
from myvllm.serving.async_llm import AsyncLLM  # noqa: E402

MAX_MODEL_LENGTH = 1024
MAX_RESPONSE_BYTES = 40 << 20
MAX_CONNECTIONS = 8
TIMEOUT_REQUEST_BODY_S = 3.0
PROMPT = [30 + i % 200 for i in range(900)]  # token ids of the byte-level vocabulary
# /health must answer within this while one request's answer is built: a generous bound
# (it answers in well under a second; before, it waited 20 s for this answer).
HEALTH_WAIT_S = 5.0


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    path = tiny_chat_checkpoint(tmp_path_factory.mktemp("tiny_attacks"),
                                max_position_embeddings=MAX_MODEL_LENGTH)
    # Room for n=128 completions of the 900-token prompt (57 blocks of it, shared).
    llm = AsyncLLM(Config(model=str(path), num_kvcache_blocks=256,
                          max_model_length=MAX_MODEL_LENGTH, max_num_sequences=32))
    limits = ServerLimits(max_response_bytes=MAX_RESPONSE_BYTES,
                          max_connections=MAX_CONNECTIONS,
                          timeout_request_body_s=TIMEOUT_REQUEST_BODY_S)
    with served_in_thread(llm, MODEL, log_level="warning", limits=limits) as url:
        yield url


def echo_logprobs_request(n: int, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": 1, "n": n, "echo": True,
            "logprobs": 20, **extra}


def estimate(n: int) -> int:
    params = SamplingParams(max_tokens=1, n=n, logprobs=20, prompt_logprobs=20)
    return estimate_response_bytes([len(PROMPT)], [params], chat=False, echo=True)


def post(base_url: str, path: str, body: dict[str, Any]) -> tuple[int, bytes]:
    return fetch("POST", f"{base_url}{path}", json.dumps(body).encode())


def check_idle(base_url: str) -> None:
    wait_for(lambda: (lambda m: m["myvllm:num_requests_running"] == 0
                      and m["myvllm:num_requests_waiting"] == 0)(metrics(base_url)),
             "no request left running or waiting")
    assert fetch("GET", f"{base_url}/health")[0] == 200


# ------------------------------------------------------------------------ response size
def test_an_answer_over_the_bound_is_a_400_with_its_size(base_url: str) -> None:
    started = time.monotonic()
    status, body = post(base_url, "/v1/completions", echo_logprobs_request(128))
    assert status == 400, body[:300]
    message = json.loads(body)["error"]["message"]
    assert f"({estimate(128):,} bytes: 128 choices of up to 901 tokens" in message, message
    assert "21 logprobs a token" in message
    assert f"allowed: an answer of at most {MAX_RESPONSE_BYTES:,} bytes" in message
    assert time.monotonic() - started < 30  # refused up front, not after building it
    # Chat: n x max_tokens x top_logprobs.
    status, body = post(base_url, "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 128,
        "max_tokens": 1000, "logprobs": True, "top_logprobs": 20})
    assert status == 400, body[:300]
    assert "128 choices of up to 1,000 tokens" in json.loads(body)["error"]["message"]
    check_idle(base_url)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


@pytest.mark.parametrize("stream", [False, True])
def test_an_answer_just_under_the_bound_is_served_while_health_answers(
        base_url: str, stream: bool) -> None:
    n = max(n for n in range(1, 129) if estimate(n) <= MAX_RESPONSE_BYTES)
    result: dict[str, Any] = {}

    def big() -> None:
        result["answer"] = post(base_url, "/v1/completions",
                                echo_logprobs_request(n, stream=stream))

    rss_before = rss_bytes()
    thread = threading.Thread(target=big)
    thread.start()
    longest_wait = peak_rss = 0.0
    while thread.is_alive():
        asked = time.monotonic()
        assert fetch("GET", f"{base_url}/health")[0] == 200
        longest_wait = max(longest_wait, time.monotonic() - asked)
        peak_rss = max(peak_rss, rss_bytes())
        time.sleep(0.05)
    thread.join()
    status, body = result["answer"]
    assert status == 200, body[:300]
    assert longest_wait < HEALTH_WAIT_S, f"/health waited {longest_wait:.1f} s"
    if stream:
        events = [json.loads(line[len(b"data: "):]) for line in body.split(b"\n\n")
                  if line.startswith(b"data: {")]
        choices = [c for e in events for c in e["choices"]]
    else:
        assert len(body) <= estimate(n)  # the estimate does not understate this answer
        choices = json.loads(body)["choices"]
    assert sorted({c["index"] for c in choices}) == list(range(n))
    first = next(c for c in choices if c["index"] == n - 1)
    assert len(first["logprobs"]["tokens"]) >= len(PROMPT)  # the echoed prompt's entries
    # The process (this test and the server in it) held at most a bounded multiple of
    # the answer's size meanwhile: the Python objects of its logprobs, and its bytes.
    assert peak_rss - rss_before < 12 * MAX_RESPONSE_BYTES
    check_idle(base_url)


# ------------------------------------------------------------------------ connections
def raw_request(base_url: str, head: bytes, timeout_s: float = 20.0) -> socket.socket:
    host, port = base_url.removeprefix("http://").split(":")
    connection = socket.create_connection((host, int(port)), timeout=timeout_s)
    connection.sendall(head)
    return connection


def read_answer(connection: socket.socket) -> bytes:
    """What the server sends until it closes the connection (or the socket's timeout)."""
    data = b""
    with contextlib.suppress(TimeoutError, ConnectionResetError):
        while chunk := connection.recv(65536):
            data += chunk
    return data


def test_connections_over_the_limit_get_a_quick_503(base_url: str) -> None:
    # MAX_CONNECTIONS kept-alive connections, each answered once (so each is held).
    held = []
    for _ in range(MAX_CONNECTIONS):
        connection = raw_request(base_url, b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        assert connection.recv(65536).startswith(b"HTTP/1.1 200"), "a held connection"
        held.append(connection)
    try:
        started = time.monotonic()
        status, body = fetch("GET", f"{base_url}/health")
        assert status == 503, body
        message = json.loads(body)["error"]["message"]
        assert f"at its limit of {MAX_CONNECTIONS} connections" in message
        assert time.monotonic() - started < 10  # at once, not after a timeout
    finally:
        for connection in held:
            connection.close()
    wait_for(lambda: fetch("GET", f"{base_url}/health")[0] == 200, "the server to serve again")


def test_a_trickled_body_gets_a_408_within_the_total_time(base_url: str) -> None:
    """A byte of the body every 0.3 s never leaves it silent for the 30 s idle timeout; the
    whole body must still come within TIMEOUT_REQUEST_BODY_S."""
    connection = raw_request(base_url, b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n"
                             b"content-type: application/json\r\ncontent-length: 1000\r\n\r\n{")
    started = time.monotonic()
    connection.settimeout(0.3)
    answer = b""
    while not answer and time.monotonic() - started < 25:
        try:
            answer = connection.recv(65536)
        except TimeoutError:
            connection.sendall(b" ")
    connection.settimeout(5)
    answer += read_answer(connection)
    connection.close()
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert f"did not arrive within {TIMEOUT_REQUEST_BODY_S:g} s".encode() in answer
    assert time.monotonic() - started < 20  # the total time, not the 30 s idle timeout
    check_idle(base_url)


# ------------------------------------------------------------------------ the log
def test_a_flood_of_bad_requests_writes_a_few_log_lines(base_url: str) -> None:
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    request_logger, uvicorn_logger = (logging.getLogger("myvllm.requests"),
                                      logging.getLogger("uvicorn.error"))
    level = request_logger.level
    request_logger.addHandler(handler)
    uvicorn_logger.addHandler(handler)
    request_logger.setLevel(logging.INFO)
    try:
        for _ in range(REFUSAL_LINES_PER_INTERVAL + 50):  # bad JSON: a 400 each
            assert fetch("POST", f"{base_url}/v1/completions", b"{bad")[0] == 400
        for _ in range(50):  # not HTTP at all: uvicorn answers 400 and warns
            read_answer(raw_request(base_url, b"NOT HTTP\r\n\r\n", timeout_s=5))
        time.sleep(0.5)  # a line is written once its answer is sent
    finally:
        request_logger.removeHandler(handler)
        uvicorn_logger.removeHandler(handler)
        request_logger.setLevel(level)
    refusals = [line for line in lines if '"POST /v1/completions HTTP/1.1" 400' in line]
    invalid = [line for line in lines if "Invalid HTTP request" in line]
    # At most the burst within the interval (the flood takes less than 10 s here; if it
    # took longer, the next interval's first line says how many were left out).
    assert len(refusals) <= REFUSAL_LINES_PER_INTERVAL + 2, len(refusals)
    assert 1 <= len(invalid) <= 2 * SERVER_LOG_BURST, invalid
    assert fetch("GET", f"{base_url}/health")[0] == 200


def test_the_rate_limiter_counts_what_it_leaves_out(monkeypatch: pytest.MonkeyPatch) -> None:
    from myvllm.entrypoints.safeguards import log_rate_limit

    now = [100.0]
    monkeypatch.setattr(log_rate_limit.time, "monotonic", lambda: now[0])
    limiter = LogRateLimiter(interval_s=10, burst=2)
    assert [limiter.admit("a") for _ in range(5)] == [0, 0, None, None, None]
    assert limiter.admit("b") == 0  # another kind: its own count
    now[0] += 10
    assert limiter.admit("a") == 3  # the first line of the next interval: 3 left out
    assert limiter.admit("a") == 0 and limiter.admit("a") is None
    assert with_count("x", 3) == "x (and 3 more like it before, not logged)"


def test_the_open_file_limit_is_raised_and_bounds_the_connections(base_url: str) -> None:
    from myvllm.entrypoints.safeguards.connection_limits import (check_max_connections,
                                                      default_max_connections)

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # make_server raised it
    assert soft == hard or hard == resource.RLIM_INFINITY
    assert default_max_connections(soft) == max(16, soft - 256)
    with pytest.raises(ValueError, match="allowed: at most"):
        check_max_connections(soft, soft)
