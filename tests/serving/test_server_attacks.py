"""Attacks on a served engine that one client can make with valid requests, and the bounds
that answer them (entrypoints/server_limits.py; docs/reliability.md, "One request or client
cannot take the server down").

One server for the module: the tiny random Qwen3 of test_server.py with room for 1,024
positions, uvicorn in a thread, limits lowered so that each attack is quick:
- an answer over max_response_bytes (n x echo x logprobs) is a 400 that gives its estimated
  size and the bound, before anything is queued; one just under the bound is served, and
  /health keeps answering meanwhile (it used to wait for the whole answer to be built).
"""

from __future__ import annotations

import json
import resource
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("openai")

from test_server import MODEL, fetch, metrics, served_in_thread, tiny_chat_checkpoint, wait_for  # noqa: E402

from myvllm import Config  # noqa: E402
from myvllm.entrypoints.response_bounds import estimate_response_bytes  # noqa: E402
from myvllm.entrypoints.server_limits import ServerLimits  # noqa: E402
from myvllm.sampling_parameters import SamplingParams  # noqa: E402
from myvllm.serving.async_llm import AsyncLLM  # noqa: E402

MAX_MODEL_LENGTH = 1024
MAX_RESPONSE_BYTES = 40 << 20
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
    limits = ServerLimits(max_response_bytes=MAX_RESPONSE_BYTES)
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
