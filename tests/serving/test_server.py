"""The OpenAI-compatible server, driven by the official `openai` client over real HTTP.

One server for this module and test_server_api.py (conftest.py), with its engine core in a child process as under `myvllm serve`
(AsyncLLM, the multiprocess client): a tiny random Qwen3 with the byte-level test tokenizer (token i =
byte i, so multi-byte characters always span tokens) and a chat template, uvicorn in a thread
on a free port. Its answers are random bytes, which is all these tests need: they compare the
server with itself (streamed against not streamed, concurrent against alone).
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import os
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

openai = pytest.importorskip("openai")

from helpers_models import build_tiny_checkpoint  # noqa: E402
from myvllm.serving.core_messages import AddRequest  # noqa: E402

MODEL = "tiny"
MAX_MODEL_LENGTH = 256  # the tiny model's max_position_embeddings
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
# The tiny model tends to repeat a prompt's last byte: prompts end differently.
PROMPTS = [f"Write a short note about the number {i}" for i in range(16)]


def free_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


@contextlib.contextmanager
def served_in_thread(llm: Any, model_name: str, join_s: float = 30.0,
                     **server_kwargs: Any) -> Iterator[str]:
    """llm (an AsyncLLM or DPAsyncLLM) behind `make_server` in a daemon thread on a free
    port; yields the base URL once uvicorn accepts connections; stops the server, then the
    engine, on the way out."""
    from myvllm.entrypoints.openai_server import make_server

    sock = free_socket()
    server = make_server(llm, model_name, "127.0.0.1", sock.getsockname()[1], **server_kwargs)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        while not server.started:  # uvicorn sets it once the socket accepts connections
            assert thread.is_alive(), "the server thread died while starting"
            time.sleep(0.05)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(join_s)
        llm.shutdown()
        sock.close()


def tiny_chat_checkpoint(path: Path, **overrides: Any) -> Path:
    """The tiny Qwen3 with a chat template (overrides go to its transformers config)."""
    from transformers import AutoTokenizer

    build_tiny_checkpoint("qwen3", path, **overrides)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(path))
    return path


# The server itself (base_url, and SERVED["llm"]: the AsyncLLM behind it) is built once for
# this module and test_server_api.py: conftest.py.
SERVED: dict[str, Any] = {}


@pytest.fixture(scope="module")
def client(base_url: str) -> Any:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


def fetch(method: str, url: str, body: bytes | None = None) -> tuple[int, bytes]:
    """(status, body) of a plain HTTP request, errors included."""
    request = urllib.request.Request(url, data=body, method=method,
                                     headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def metrics(base_url: str) -> dict[str, float]:
    """The samples of /metrics by metric name (the labels dropped)."""
    values = {}
    for line in fetch("GET", f"{base_url}/metrics")[1].decode().splitlines():
        if line.startswith("#") or not line:
            continue
        name_labels, value = line.rsplit(" ", 1)
        values[name_labels.split("{")[0]] = float(value)
    return values


def finished_by_reason(base_url: str) -> dict[str, float]:
    """myvllm:request_success_total by its finished_reason label."""
    counts = {}
    for line in fetch("GET", f"{base_url}/metrics")[1].decode().splitlines():
        if line.startswith("myvllm:request_success_total{"):
            reason = line.split('finished_reason="')[1].split('"')[0]
            counts[reason] = float(line.rsplit(" ", 1)[1])
    return counts


def wait_for(condition: Any, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting: {what}"
        time.sleep(0.05)


def test_health_and_models(base_url: str, client: Any) -> None:
    assert fetch("GET", f"{base_url}/health")[0] == 200
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_completion_streamed_equals_not_streamed(client: Any) -> None:
    kwargs = dict(model=MODEL, prompt="The capital of France is", max_tokens=12, temperature=0,
                  extra_body={"ignore_eos": True})
    full = client.completions.create(**kwargs)
    choice = full.choices[0]
    assert choice.text and choice.finish_reason == "length"
    assert full.usage.prompt_tokens == len(b"The capital of France is")
    assert full.usage.completion_tokens == 12
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens

    chunks = list(client.completions.create(**kwargs, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage
    assert len([c for c in chunks if c.choices]) > 1  # it did stream


def test_chat_streamed_equals_not_streamed(client: Any) -> None:
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "What is 2 + 2?"}],
                  max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kwargs)
    message = full.choices[0].message
    assert message.role == "assistant" and message.content
    template = "<|user|>What is 2 + 2?\n<|assistant|>"
    assert full.usage.prompt_tokens == len(template.encode())
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == message.content
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason


def test_stop_string_spanning_tokens(client: Any) -> None:
    # Seeded sampling, hot enough for varied bytes (the tiny model's greedy answer repeats
    # one byte), the same ones at every request.
    kwargs = dict(model=MODEL, prompt="Count: one, two, three,", max_tokens=32, temperature=20.0,
                  seed=7, extra_body={"ignore_eos": True})
    text = client.completions.create(**kwargs).choices[0].text
    # Two characters from inside the answer (each a token or more), not a replacement char.
    start = next(i for i in range(3, len(text) - 1) if "\ufffd" not in text[i:i + 2])
    stop = text[start:start + 2]
    assert text.find(stop) > 0
    cut = client.completions.create(**kwargs, stop=[stop])
    assert cut.choices[0].text == text[:text.find(stop)]
    assert cut.choices[0].finish_reason == "stop"
    streamed = client.completions.create(**kwargs, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == text[:text.find(stop)]


def test_16_concurrent_streams_match_their_greedy_answers(base_url: str, client: Any) -> None:
    async def run_all() -> tuple[list[str], list[str]]:
        aclient = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused",
                                     max_retries=0)
        kwargs: dict[str, Any] = dict(model=MODEL, max_tokens=8, temperature=0,
                                      extra_body={"ignore_eos": True})

        async def streamed(prompt: str) -> str:
            stream = await aclient.completions.create(prompt=prompt, stream=True, **kwargs)
            return "".join([c.choices[0].text async for c in stream])

        async def whole(prompt: str) -> str:
            return (await aclient.completions.create(prompt=prompt, **kwargs)).choices[0].text

        texts = await asyncio.gather(*(streamed(p) for p in PROMPTS))
        wholes = await asyncio.gather(*(whole(p) for p in PROMPTS))
        await aclient.close()
        return list(texts), list(wholes)

    texts, wholes = asyncio.run(run_all())
    assert texts == wholes
    assert len(set(texts)) > 1  # different prompts, different answers: no mix-up


def test_only_streamed_requests_are_streams_to_the_engine(client: Any) -> None:
    """A request with stream false gets one body at the end: the engine need not keep the
    steps it decodes in short (Sequence.streamed False). A streamed one is a stream. What
    the front end sends the core says which (the core passes it to add_request:
    test_engine_core_process.py)."""
    llm = SERVED["llm"]
    send = llm._send
    seen: list[bool] = []

    def spy(message: Any) -> None:
        if isinstance(message, AddRequest):
            seen.append(message.streamed)
        send(message)

    llm._send = spy
    try:
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=2)
        list(client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, stream=True))
        client.chat.completions.create(model=MODEL, max_tokens=2,
                                       messages=[{"role": "user", "content": "Hi"}])
    finally:
        del llm._send  # the class's method again
    assert seen == [False, True, False]


def test_the_engine_core_runs_in_a_process_of_its_own(base_url: str) -> None:
    llm = SERVED["llm"]
    assert llm.core_pid is not None and llm.core_pid != os.getpid()
    assert Path(f"/proc/{llm.core_pid}").is_dir() or not Path("/proc").is_dir()


def stream_until(base_url: str, body: dict[str, Any], events: int
                 ) -> http.client.HTTPConnection:
    """A streamed /v1/completions request, read until `events` data events have arrived;
    the connection is left open (closing it is the client going away)."""
    host, port = base_url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    connection.request("POST", "/v1/completions", json.dumps(body),
                       {"content-type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200
    received = 0
    while received < events:
        if response.readline().startswith(b"data: "):
            received += 1
    return connection


def test_aborted_stream_frees_its_blocks(base_url: str) -> None:
    body = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 224,
            "ignore_eos": True, "stream": True}
    connection = stream_until(base_url, body, 3)
    now = metrics(base_url)
    assert now["myvllm:num_requests_running"] == 1
    assert now["myvllm:kv_cache_usage_perc"] > 0
    aborts = finished_by_reason(base_url).get("abort", 0.0)
    connection.close()  # the client goes away in the middle of the stream
    wait_for(lambda: metrics(base_url)["myvllm:num_requests_running"] == 0,
             "the aborted request to leave the running queue")
    wait_for(lambda: metrics(base_url)["myvllm:kv_cache_usage_perc"] == 0.0,
             "the aborted request's blocks to be freed")
    # A client that went away is an aborted request in /metrics too.
    wait_for(lambda: finished_by_reason(base_url).get("abort", 0.0) == aborts + 1,
             "the abort to be counted")


BAD_REQUESTS = [
    ("/v1/completions", b'{"prompt": "hi", ', 400),  # malformed JSON
    ("/v1/completions", b'[1, 2]', 400),  # not an object
    ("/v1/completions", {"prompt": "hi", "max_tokens": "5"}, 400),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400),
    ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, 400),
    ("/v1/completions", {"prompt": "hi", "top_k": -2}, 400),
    ("/v1/completions", {"prompt": "hi", "seed": -1}, 400),
    ("/v1/completions", {"prompt": "hi", "stop": [""]}, 400),
    ("/v1/completions", {"prompt": "hi", "n": 0}, 400),
    ("/v1/completions", {"prompt": "hi", "n": 129}, 400),  # more than OpenAI's limit
    ("/v1/completions", {"prompt": "hi", "n": 2, "best_of": 3}, 400),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, 400),
    ("/v1/completions", {"prompt": ""}, 400),
    ("/v1/completions", {"max_tokens": 4}, 400),  # no prompt
    ("/v1/completions", {"prompt": [1, 2, 10**9]}, 400),  # token id outside the vocabulary
    ("/v1/completions", {"prompt": "word " * (MAX_MODEL_LENGTH + 10)}, 400),  # too long
    ("/v1/completions", {"prompt": "word " * (MAX_MODEL_LENGTH + 10), "stream": True}, 400),
    # Exactly max_model_length tokens: no room left for the first completion token.
    ("/v1/completions", {"prompt": [5] * MAX_MODEL_LENGTH}, 400),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404),
    ("/v1/chat/completions", {"messages": []}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user"}], "n": "3"}, 400),
    ("/v1/chat/completions", {"messages": [{"content": "no role"}]}, 400),
    ("/v1/chat/completions", {"messages": "hello"}, 400),
    ("/v1/nothing", {}, 404),
]


@pytest.mark.parametrize("path, body, status", BAD_REQUESTS)
def test_bad_request_gets_a_4xx_with_openai_error_json(base_url: str, path: str, body: Any,
                                                       status: int) -> None:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    code, answer = fetch("POST", f"{base_url}{path}", content)
    assert code == status, answer
    error = json.loads(answer)["error"]
    assert error["code"] == status and error["message"]


def test_server_stays_up_after_bad_requests(base_url: str, client: Any) -> None:
    with pytest.raises(openai.BadRequestError, match="max_model_length"):
        client.completions.create(model=MODEL, prompt="word " * (MAX_MODEL_LENGTH + 10))
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="hi")
    assert fetch("GET", f"{base_url}/health")[0] == 200
    out = client.completions.create(model=MODEL, prompt="Hello", max_tokens=2)
    assert out.usage.completion_tokens >= 1


def test_metrics_names(base_url: str) -> None:
    names = metrics(base_url)
    for name in ("myvllm:num_requests_running", "myvllm:num_requests_waiting",
                 "myvllm:kv_cache_usage_perc", "myvllm:prefix_cache_queries_total",
                 "myvllm:prefix_cache_hits_total", "myvllm:time_to_first_token_seconds_count",
                 "myvllm:inter_token_latency_seconds_count",
                 "myvllm:e2e_request_latency_seconds_count"):
        assert name in names, name
    assert names["myvllm:time_to_first_token_seconds_count"] > 0
    # The same prompt twice: the second finds the first's full blocks in the prefix cache.
    before = names["myvllm:prefix_cache_hits_total"]
    prompt = "A prompt long enough to fill two blocks of sixteen tokens with words. " * 3
    for _ in range(2):
        fetch("POST", f"{base_url}/v1/completions",
             json.dumps({"prompt": prompt, "max_tokens": 1}).encode())
    assert metrics(base_url)["myvllm:prefix_cache_hits_total"] >= before + 16
