"""The server under faults: random malformed or extreme requests, and clients that go away.

One server for the module (a tiny random Qwen3 with the byte-level tokenizer and a chat
template, as in test_server.py), with a small KV cache so that a block held by a request that
should be gone shows in the engine's free list.

- Fault matrix: random requests, each broken in one way (wrong types, huge numbers, negative
  values, unicode, empty or missing fields, bad JSON, a 10 MB body, 1,000 stop strings, the
  wrong content type, method or route), get a 4xx with OpenAI's error JSON; extreme values
  that are still valid (a prompt of NUL characters, a temperature of 1e-320, the largest
  seed) may also get a 200. Never a 5xx, never a hang (every request has a timeout); the
  server answers /health with 200 afterwards, and nothing is left running or holding blocks.
- Disconnects: clients that leave at random points (before their body is complete, before
  the answer, in the middle of a stream, while a non-streamed answer is computed) leave no
  request running and no block held.

The default run takes a short slice of each; `uv run pytest -m slow` runs 1,000 requests and
200 clients.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import random
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

pytest.importorskip("openai")

from test_server import (  # noqa: E402
    MODEL,
    fetch,
    free_socket,
    metrics,
    tiny_chat_checkpoint,
    wait_for,
)

from myvllm import Config  # noqa: E402
from myvllm.serving.async_llm import AsyncLLM  # noqa: E402
from myvllm.entrypoints.openai_server import make_server  # noqa: E402

# Long enough that a request whose client left can't end on its own while the test watches:
# its max_tokens is most of the 1,024 slots of the KV cache.
MAX_MODEL_LENGTH = 1024
NUM_BLOCKS = 64  # 16 tokens each: 1,024 slots for up to 32 sequences
REQUEST_TIMEOUT_S = 60  # a request not answered by then is a hang, and fails the test


@dataclass
class Served:
    base_url: str
    host: str
    port: int
    llm: AsyncLLM


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    # test_server.py's tiny chat model, with room for MAX_MODEL_LENGTH positions.
    path = tiny_chat_checkpoint(tmp_path_factory.mktemp("tiny_chat_faults"),
                                max_position_embeddings=MAX_MODEL_LENGTH)
    llm = AsyncLLM(Config(model=str(path), num_kvcache_blocks=NUM_BLOCKS,
                          max_model_length=MAX_MODEL_LENGTH, max_num_sequences=32))
    sock = free_socket()
    port = sock.getsockname()[1]
    server = make_server(llm, MODEL, "127.0.0.1", port, log_level="warning")
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        assert thread.is_alive(), "the server thread died while starting"
        time.sleep(0.05)
    yield Served(f"http://127.0.0.1:{port}", "127.0.0.1", port, llm)
    server.should_exit = True
    thread.join(30)
    llm.shutdown()
    sock.close()


def check_nothing_held(served: Served) -> None:
    """No request running or waiting and every block free, as the engine core reports it
    in /metrics, and no stream state left in the front end."""
    wait_for(lambda: (lambda m: m["myvllm:num_requests_running"] == 0
                      and m["myvllm:num_requests_waiting"] == 0
                      and m["myvllm:kv_cache_usage_perc"] == 0.0)(metrics(served.base_url)),
             "every request to end and free its blocks")
    wait_for(lambda: not served.llm._by_request_id and not served.llm._streams,
             "the front end to hold no stream")
    assert fetch("GET", f"{served.base_url}/health")[0] == 200


# ---------------------------------------------------------------------------- fault matrix
@dataclass
class Fault:
    what: str  # for the failure message
    method: str
    path: str
    body: bytes
    content_type: str = "application/json"
    valid: bool = False  # extreme but valid: a 200 is right too


COMPLETION = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2}

# Field -> values that must be refused (each one alone, in an otherwise valid request).
BAD_SHARED: dict[str, list[Any]] = {
    "model": [5, [], {}, True, "no-such-model", ""],
    # More than the context holds beside the prompt: refused, not cut short.
    "max_tokens": ["5", 5.5, True, 0, -1, -10**30, [], {}, "", 1e400, 10**20, 2**63,
                   MAX_MODEL_LENGTH],
    "temperature": ["1", -1, -1e-300, -1e308, True, [], {}, "NaN"],
    "top_p": [0, -0.5, 1.0000001, 2, 1e308, "0.5", True, []],
    "top_k": [-2, -10**30, 10**20, 2**63, 0.5, "5", True],
    "seed": [-1, 2**64, 10**30, 1.5, "1", True],
    "stop": [5, [5], [""], "", [None], {"a": 1}, ["a"] * 1000, ["a" * 1000], [["a"]]],
    "n": [0, 129, -1, "1", 1.5, 10**30],
    "stream": ["yes", 1, None, []],
    "stream_options": [5, {"include_usage": "x"}, [], "x"],
    "ignore_eos": [1, "true", None, []],
    "presence_penalty": ["x", [], 3, -2.5, True],
    "frequency_penalty": [2.01, {}, "0"],
    "repetition_penalty": [0, -1, "1.2", 1e400],
    "min_p": [2, -0.1, "0.1"],
    # OpenAI's shape: string token ids, biases in [-100, 100], inside the vocabulary (256).
    "logit_bias": [5, "x", [1], {"1": 101}, {"1": -100.5}, {"a": 1}, {"-1": 1}, {"1.5": 1},
                   {"256": 1}, {"1": "1"}, {"١": 1}],
    "min_tokens": [-1, "1", 1.5, 3],  # 3: more than max_tokens (2)
    "stop_token_ids": [[-1], "x", [256], [1.5], 5],
    # Structured outputs: malformed or contradictory constraints.
    "response_format": [{"type": "json_schema", "json_schema": {}}, {"type": "json_schema"},
                        {"type": "text", "json_schema": {"name": "x", "schema": {}}},
                        {"type": "json_schema", "json_schema": {"name": "x", "schema": 5}},
                        {"type": "xml"}, "json"],
    "structured_outputs": [{}, {"regex": "a", "choice": ["a"]}, {"choice": []},
                           {"json": "{not json"}, {"regex": "(unclosed"}, 5],
    "guided_choice": [[], [""], "a", [1]],
    "guided_json": ["[1, 2]", 5, "{"],
    "unknown_field": [{"nested": [1, 2, 3]}, None, 1],
}
BAD_COMPLETION: dict[str, list[Any]] = {
    "prompt": [None, 5, 1.5, True, {}, [], [1, "a"], [-1], [10**30], [256], [2**63], "", [""],
               [[]], [1.5], "word " * 2 * MAX_MODEL_LENGTH, ["a", ""], [[1, 2], [1, 300]],
               ["a", 5], [[1], "a"], [[1, 2], []], ["a", "word " * 2 * MAX_MODEL_LENGTH],
               [1 + i % 255 for i in range(MAX_MODEL_LENGTH + 1)]],
    "logprobs": [-1, 21, True, 1.5, "1", 10**30],
    "echo": ["x", 1],
    "best_of": [2, 0, -5, "1"],
    "suffix": ["x", 5, ""],  # refused at any value but null
}
BAD_CHAT: dict[str, list[Any]] = {
    "messages": [None, [], "hello", [{}], [{"content": "no role"}], [{"role": 5, "content": "x"}],
                 [{"role": "user", "content": 5}], [[]], [None],
                 [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
                 [{"role": "user", "content": [{"type": "text"}]}],
                 [{"role": "user", "content": [{"type": "text", "text": 5}]}],
                 [{"role": "user", "content": "word " * 2 * MAX_MODEL_LENGTH}],
                 [{"role": "user", "content": "x", "tool_calls": [{"id": "1"}]}],
                 [{"role": "user", "content": "x", "unknown": 1}]],
    "tools": [[{"type": "function", "function": {"name": "f"}}], 5],
    "tool_choice": ["auto", {"type": "function"}],
    "logprobs": [1, "true", []],
    "top_logprobs": [1, 21, -1, 1.5],  # 1: without logprobs true
    "max_completion_tokens": [0, -1, "5", 1.5],
    "chat_template_kwargs": [5, [], "x", {"tokenize": True}, {"conversation": 1},
                             {"tools": 5}, {"continue_final_message": True},
                             {"add_generation_prompt": "x"}],
}
# Extreme values a request may carry and still be served.
EXTREME: dict[str, list[Any]] = {
    "prompt": ["\x00" * 8, "\U0001f600" * 20, "\u202e\u0301\uffff\ufeff", "e\u0301" * 30,
               "x" * (MAX_MODEL_LENGTH - 4), [1 + i % 255 for i in range(MAX_MODEL_LENGTH - 4)],
               [0], ["a", "b"], [[1, 2], [3]], ["x" * (MAX_MODEL_LENGTH - 4)] * 3],
    "temperature": [0, 1e-320, 1e-30, 1e30, 1e308],
    "top_p": [1e-300, 5e-324, 1],
    "top_k": [1, 0, -1, 2**63 - 1, 10**6],
    "seed": [0, 2**64 - 1],
    "stop": [["\U0001f600"], ["a"] * 64, ["b" * 256], "\n"],
    "max_tokens": [1, 40],  # 40: with a prompt of the rest of the context (below)
    "ignore_eos": [True],
    "logprobs": [None, 0, 20],  # chat: a 400 unless null
    "echo": [False, True],  # chat: a 400 (not one of its fields)
    "best_of": [1, None],
    "n": [1, 2],
    "presence_penalty": [0, 0.0, None, -2, 2],
    "frequency_penalty": [0, -2.0, 2],
    "repetition_penalty": [1, 1.0, 1e-30, 1e30],
    "min_p": [0, 1, 1e-300],
    "logit_bias": [{}, None, {"0": 100, "255": -100}, {str(t): 1e-300 for t in range(256)}],
    "min_tokens": [0, 1],  # at most max_tokens, which may be 1 here
    "stop_token_ids": [[], [0, 255], [5] * 100],
    "response_format": [{"type": "text"}, {"type": "json_object"},
                        {"type": "json_schema", "json_schema": {"name": "x", "schema": {
                            "type": "object", "properties": {"a": {"type": "integer"}}}}}],
    "guided_choice": [["\U0001f600", "a\"b\\c\n"]],
    "guided_regex": ["[a-z]+", "\\d{3}"],
    # Not supported yet, at the values that ask for nothing (clients send them).
    "suffix": [None],
    "user": ["someone", None],
}
BAD_JSON = [b"", b"{", b'{"prompt": "hi", ', b"null", b"1", b'"x"', b"[]", b"true",
            b"[" * 100_000 + b"]" * 100_000, b'{"a": ' * 50_000, b"\xff\xfe\x00",
            b'{"prompt": "\\ud800"}', b'{"prompt": "hi", "temperature": NaN}',
            b'{"prompt": "hi", "max_tokens": Infinity}', b"{'prompt': 'hi'}",
            b'{"prompt": "hi"}{"prompt": "hi"}', b'{"prompt": "hi",}', b"\x00" * 100]


class FaultMaker:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def base(self) -> tuple[str, dict[str, Any], dict[str, list[Any]]]:
        if self.rng.random() < 0.5:
            return "/v1/completions", dict(COMPLETION), {**BAD_SHARED, **BAD_COMPLETION}
        return "/v1/chat/completions", dict(CHAT), {**BAD_SHARED, **BAD_CHAT}

    def make(self) -> Fault:
        rng = self.rng
        kind = rng.choices(["field", "two", "missing", "json", "extreme", "type", "route"],
                           [40, 10, 5, 10, 25, 5, 5])[0]
        path, body, bad = self.base()
        if kind in ("field", "two"):
            fields = rng.sample(sorted(bad), 1 if kind == "field" else 2)
            for name in fields:
                body[name] = rng.choice(bad[name])
            return Fault(f"{path} {fields}", "POST", path, encode(body))
        if kind == "missing":
            del body["prompt" if "prompt" in body else "messages"]
            return Fault(f"{path} missing", "POST", path, encode(body))
        if kind == "json":
            return Fault(f"{path} bad JSON", "POST", path, rng.choice(BAD_JSON))
        if kind == "extreme":
            names = rng.sample(sorted(EXTREME), rng.randint(1, 3))
            for name in names:
                body[name] = rng.choice(EXTREME[name])
            if body["max_tokens"] > 2:  # the prompt and max_tokens fill the context exactly
                body["prompt"] = "x" * (MAX_MODEL_LENGTH - body["max_tokens"])
            if "messages" in body and "prompt" in body:  # the template adds ~20 tokens
                content = str(body.pop("prompt"))[:MAX_MODEL_LENGTH - 40]
                body["messages"] = [{"role": "user", "content": content}]
            return Fault(f"{path} extreme {names}", "POST", path, encode(body), valid=True)
        if kind == "type":
            content_type, raw, valid = rng.choice([
                ("text/plain", encode(body), True),  # JSON all the same: served
                ("", encode(body), True),
                ("application/x-www-form-urlencoded", b"prompt=hi&max_tokens=2", False),
                ("multipart/form-data; boundary=x",
                 b'--x\r\nContent-Disposition: form-data; name="prompt"\r\n\r\nhi\r\n--x--\r\n',
                 False),
                ("application/json; charset=latin-1", "{\"prompt\": \"\xe9\"}".encode("latin-1"),
                 False),
            ])
            return Fault(f"{path} content type {content_type!r}", "POST", path, raw,
                         content_type, valid)
        method, route = rng.choice([("GET", path), ("PUT", path), ("DELETE", "/health"),
                                    ("POST", "/v1/nothing"), ("POST", "/health"),
                                    ("GET", "/v1/" + "x" * 5000), ("POST", "/v1/models")])
        return Fault(f"{method} {route[:40]}", method, route, encode(body))


def encode(body: dict[str, Any]) -> bytes:
    return json.dumps(body).encode()


def send(served: Served, fault: Fault) -> tuple[int, bytes]:
    connection = http.client.HTTPConnection(served.host, served.port,
                                            timeout=REQUEST_TIMEOUT_S)
    try:
        headers = {"content-type": fault.content_type} if fault.content_type else {}
        connection.request(fault.method, fault.path, fault.body, headers)
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def check_answer(fault: Fault, status: int, answer: bytes) -> None:
    assert status < 500, (fault.what, status, answer[:300])
    if fault.valid and status == 200:
        return
    assert 400 <= status < 500, (fault.what, status, answer[:300])
    error = json.loads(answer)["error"]
    assert error["code"] == status and error["message"], (fault.what, answer[:300])


def listed_faults() -> Iterator[Fault]:
    """Every value of the tables above once (a shared field's values alternate between the
    two routes), every bad JSON body on both routes."""
    for i, (name, values) in enumerate(sorted(BAD_SHARED.items())):
        for j, value in enumerate(values):
            path, base = (("/v1/completions", COMPLETION) if (i + j) % 2
                          else ("/v1/chat/completions", CHAT))
            yield Fault(f"{path} {name}={value!r:.40}", "POST", path,
                        encode({**base, name: value}))
    for path, base, table in (("/v1/completions", COMPLETION, BAD_COMPLETION),
                              ("/v1/chat/completions", CHAT, BAD_CHAT)):
        for name, values in sorted(table.items()):
            for value in values:
                yield Fault(f"{path} {name}={value!r:.40}", "POST", path,
                            encode({**base, name: value}))
        for raw in BAD_JSON:
            yield Fault(f"{path} {raw[:40]!r}", "POST", path, raw)
    for name, values in sorted(EXTREME.items()):
        for value in values:
            body = {**COMPLETION, name: value}
            if name == "max_tokens":
                body["prompt"] = "x" * (MAX_MODEL_LENGTH - value)
            yield Fault(f"extreme {name}={value!r:.40}", "POST", "/v1/completions",
                        encode(body), valid=True)


def test_every_listed_fault_gets_its_answer(served: Served) -> None:
    for fault in listed_faults():
        check_answer(fault, *send(served, fault))
    check_nothing_held(served)


def run_fault_matrix(served: Served, num_requests: int) -> None:
    maker = FaultMaker(seed=num_requests)
    statuses: dict[int, int] = {}
    for _ in range(num_requests):
        fault = maker.make()
        status, answer = send(served, fault)
        check_answer(fault, status, answer)
        statuses[status] = statuses.get(status, 0) + 1
    assert statuses.get(400, 0) > num_requests // 4, statuses
    assert statuses.get(200, 0) > 0, statuses  # the extreme-but-valid ones are served
    check_nothing_held(served)


def test_fault_matrix_short(served: Served) -> None:
    run_fault_matrix(served, 100)


@pytest.mark.slow
def test_fault_matrix_1000(served: Served) -> None:
    run_fault_matrix(served, 1000)


def test_ten_megabyte_body_gets_413(served: Served) -> None:
    huge = encode({"prompt": "x" * 10_000_000})
    for path in ("/v1/completions", "/v1/chat/completions"):
        status, answer = send(served, Fault("10 MB", "POST", path, huge))
        assert status == 413, answer[:300]
        assert "limit" in json.loads(answer)["error"]["message"]
    # Without a Content-Length (chunked), the limit holds while the body arrives.
    with socket.create_connection((served.host, served.port), timeout=REQUEST_TIMEOUT_S) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                  b"Transfer-Encoding: chunked\r\ncontent-type: application/json\r\n\r\n")
        chunk = b"x" * (1 << 20)
        for _ in range(3):
            s.sendall(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
        s.sendall(b"0\r\n\r\n")
        assert s.recv(1024).startswith(b"HTTP/1.1 413")
    assert fetch("GET", f"{served.base_url}/health")[0] == 200


def test_too_many_or_too_long_stop_strings_get_400(served: Served) -> None:
    for stop, words in ((["a"] * 1000, "len(stop)=1000: allowed: at most 64"),
                        (["a" * 1000], "len(stop[0])=1000: allowed: at most 256 characters")):
        status, answer = send(served, Fault("stop", "POST", "/v1/completions",
                                            encode({**COMPLETION, "stop": stop})))
        assert status == 400
        assert words in json.loads(answer)["error"]["message"]


# ---------------------------------------------------------------------------- disconnects
def natural_ends(base_url: str) -> float:
    """Requests that finished on their own ("stop" or "length"), from /metrics."""
    total = 0.0
    for line in fetch("GET", f"{base_url}/metrics")[1].decode().splitlines():
        if line.startswith("myvllm:request_success_total{") and (
                'finished_reason="stop"' in line or 'finished_reason="length"' in line):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def disconnecting_client(served: Served, rng: random.Random, i: int) -> str:
    """One client; returns where it left: "read-all" read its whole answer, the others left
    before it was complete. Those ask for most of the KV cache, so their request can only
    end by an abort while the test runs."""
    stream = rng.random() < 0.5
    chat = rng.random() < 0.3
    where = rng.choices(["mid-body", "after-body", "mid-answer", "read-all"], [10, 30, 45, 15])[0]
    path = "/v1/chat/completions" if chat else "/v1/completions"
    text = f"Client {i} says: " + "words " * rng.randint(0, 20)
    max_tokens = rng.randint(1, 16) if where == "read-all" else MAX_MODEL_LENGTH - 200
    body: dict[str, Any] = {"max_tokens": max_tokens, "ignore_eos": True, "stream": stream,
                            "temperature": rng.choice([0, 1.0])}
    if chat:
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    raw = encode(body)
    head = (f"POST {path} HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
            f"content-length: {len(raw)}\r\nconnection: close\r\n\r\n").encode()
    reader, writer = await asyncio.open_connection(served.host, served.port)
    try:
        if where == "mid-body":
            writer.write(head + raw[:rng.randint(0, len(raw) - 1)])
            await writer.drain()
            await asyncio.sleep(rng.random() * 0.05)
            return where
        writer.write(head + raw)
        await writer.drain()
        if where == "after-body":
            await asyncio.sleep(rng.random() * 0.2)  # the request may be queued, or running
            return where
        if where == "mid-answer" and not stream:
            await asyncio.sleep(rng.random() * 0.5)  # the answer is being computed
            return where
        stop_after = rng.randint(1, 20) if where == "mid-answer" else -1
        lines = []
        while True:  # the status line, headers, then the body (ends when the server closes)
            line = await asyncio.wait_for(reader.readline(), REQUEST_TIMEOUT_S)
            lines.append(line)
            if len(lines) == stop_after:
                return where
            if not line:
                break
        assert lines[0].startswith(b"HTTP/1.1 200"), lines[:3]
        assert not stream or b"data: [DONE]\n" in lines
        return where
    finally:
        writer.close()  # the client goes away: the server sees the connection close


def run_disconnects(served: Served, num_clients: int) -> None:
    rng = random.Random(num_clients)
    natural_before = natural_ends(served.base_url)

    async def main() -> dict[str, int]:
        wheres: dict[str, int] = {}
        pending: set[asyncio.Task[str]] = set()
        for i in range(num_clients):
            if len(pending) >= 40:
                done, pending = await asyncio.wait(pending,
                                                   return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    wheres[task.result()] = wheres.get(task.result(), 0) + 1
            pending.add(asyncio.create_task(disconnecting_client(served, rng, i)))
        for where in await asyncio.gather(*pending):
            wheres[where] = wheres.get(where, 0) + 1
        return wheres

    wheres = asyncio.run(main())
    assert sum(wheres.values()) == num_clients and len(wheres) == 4, wheres
    check_nothing_held(served)
    # Only the clients that read their whole answer saw their request end on its own; every
    # other request was aborted (and check_nothing_held saw its blocks come back).
    assert natural_ends(served.base_url) - natural_before == wheres["read-all"], wheres
    # And the server still serves.
    status, answer = fetch("POST", f"{served.base_url}/v1/completions", encode(COMPLETION))
    assert status == 200, answer


def test_disconnecting_clients_short(served: Served) -> None:
    run_disconnects(served, 40)


@pytest.mark.slow
def test_disconnecting_clients_200(served: Served) -> None:
    run_disconnects(served, 200)
