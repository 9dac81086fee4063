"""The server's API surface beyond generating one prompt: prompt batches, /tokenize and
/detokenize, GET /v1/models/{id}, fields that are not supported (yet), max_tokens beyond the
context, the request log, the OpenAPI schema and the connection deadlines.

test_server.py's server (conftest.py; the tiny random Qwen3 with the byte-level
tokenizer: token i = byte i, so a prompt's token count is its length in bytes).
"""

from __future__ import annotations

import asyncio
import json
import re
import logging
import socket
import threading
import time
from typing import Any

import pytest

openai = pytest.importorskip("openai")

from test_server import MAX_MODEL_LENGTH, MODEL, SERVED, fetch, free_socket, wait_for  # noqa: E402,E501

from myvllm import SamplingParams  # noqa: E402
from myvllm.serving.async_llm import AsyncLLM  # noqa: E402
from myvllm.serving.core_messages import AddRequest  # noqa: E402
from myvllm.entrypoints import openai_server  # noqa: E402
from myvllm.entrypoints.safeguards.h11_deadlines import DeadlineConfig, H11WithHeadDeadline  # noqa: E402

PROMPTS = ["The first prompt", "A second, longer prompt", "Third"]
GREEDY: dict[str, Any] = dict(model=MODEL, max_tokens=6, temperature=0,
                              extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def served(base_url: str) -> tuple[str, AsyncLLM]:
    """test_server.py's server (conftest.py builds it once for both modules)."""
    return base_url, SERVED["llm"]


@pytest.fixture(scope="module")
def client(base_url: str) -> Any:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


def post(base_url: str, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    status, answer = fetch("POST", f"{base_url}{path}", json.dumps(body).encode())
    return status, json.loads(answer)


# ---------------------------------------------------------------------------- prompt batches
def test_a_batch_of_prompts_answers_each_as_alone(client: Any) -> None:
    alone = [client.completions.create(prompt=p, **GREEDY) for p in PROMPTS]
    batch = client.completions.create(prompt=PROMPTS, **GREEDY)
    assert [c.index for c in batch.choices] == [0, 1, 2]
    assert [c.text for c in batch.choices] == [a.choices[0].text for a in alone]
    assert batch.usage.prompt_tokens == sum(len(p.encode()) for p in PROMPTS)
    assert batch.usage.completion_tokens == 3 * 6
    # Token-id lists, and one token-id list.
    ids = [list(p.encode()) for p in PROMPTS]
    by_ids = client.completions.create(prompt=ids, **GREEDY)
    assert [c.text for c in by_ids.choices] == [c.text for c in batch.choices]
    one = client.completions.create(prompt=ids[1], **GREEDY)
    assert one.choices[0].text == batch.choices[1].text and one.choices[0].index == 0


def test_a_streamed_batch_carries_each_choice_index(client: Any) -> None:
    whole = client.completions.create(prompt=PROMPTS, **GREEDY)
    chunks = list(client.completions.create(prompt=PROMPTS, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    texts = ["", "", ""]
    reasons: list[str | None] = [None, None, None]
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        texts[choice.index] += choice.text
        reasons[choice.index] = choice.finish_reason or reasons[choice.index]
    assert texts == [c.text for c in whole.choices]
    assert reasons == ["length"] * 3
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


def test_a_bad_prompt_in_a_batch_is_a_400_naming_it_before_any_work(served: Any) -> None:
    base_url, llm = served
    sent: list[Any] = []
    send = llm._send
    llm._send = lambda message: (sent.append(message), send(message))
    try:
        cases = [(["fine", "word " * MAX_MODEL_LENGTH], "prompt[1]"),
                 ([[1, 2], [3, 10**6]], "prompt[1]: token_ids[1]=1000000: allowed: a token id"),
                 (["ok", "ok", ""], "prompt[2]='': allowed: a text or token ids, not empty"),
                 (["fine", "x" * 200], "prompt[1]: max_tokens=100: allowed: at most")]
        for prompt, words in cases:
            status, answer = post(base_url, "/v1/completions",
                                  {"prompt": prompt, "max_tokens": 100, "stream": True})
            assert status == 400 and words in answer["error"]["message"], (prompt, answer)
    finally:
        del llm._send
    assert not [m for m in sent if isinstance(m, AddRequest)]


def test_async_generate_refuses_a_bad_call_in_the_form(served: Any) -> None:
    """AsyncLLM.generate's own refusals, before anything is sent to the core: what was given,
    then what is allowed (run on the server's event loop, the one the engine is bound to)."""
    _, llm = served
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)

    async def first_output(**kwargs: Any) -> None:
        async for _ in llm.generate("hi", **kwargs):
            break

    async def same_id_twice() -> None:
        running = llm.generate("hi", params, request_id="twice")
        await running.__anext__()
        try:
            await first_output(sampling_params=params, request_id="twice")
        finally:
            await running.aclose()  # aborts it

    with pytest.raises(TypeError, match=r"sampling_params=\{'max_tokens': 5\}: allowed: a "
                                        "SamplingParams"):
        asyncio.run_coroutine_threadsafe(first_output(sampling_params={"max_tokens": 5}),
                                         llm._loop).result(120)
    with pytest.raises(ValueError, match="request_id='twice': allowed: an id not already "
                                         "running"):
        asyncio.run_coroutine_threadsafe(same_id_twice(), llm._loop).result(120)


# ---------------------------------------------------------------------------- tokenize
def test_tokenize_and_detokenize(base_url: str, client: Any) -> None:
    status, answer = post(base_url, "/tokenize", {"model": MODEL, "prompt": "Hi there"})
    assert status == 200
    assert answer == {"tokens": list(b"Hi there"), "count": 8,
                      "max_model_len": MAX_MODEL_LENGTH}
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    status, answer = post(base_url, "/tokenize", {"messages": messages})
    chat = client.chat.completions.create(messages=messages, **GREEDY)
    assert status == 200 and answer["count"] == chat.usage.prompt_tokens
    status, answer = post(base_url, "/tokenize", {"messages": messages,
                                                  "add_generation_prompt": False})
    assert bytes(answer["tokens"]) == b"<|user|>What is 2 + 2?\n"
    status, answer = post(base_url, "/detokenize", {"tokens": list("héllo".encode())})
    assert (status, answer) == (200, {"prompt": "héllo"})
    for path, body, words in [("/detokenize", {"tokens": [300]}, "token_ids[0]=300: allowed:"),
                              ("/detokenize", {"tokens": "x"}, "tokens"),
                              ("/tokenize", {"prompt": 5}, "prompt"),
                              ("/tokenize", {"prompt": "x", "model": "other"}, "`tiny`"),
                              ("/tokenize", {"messages": [], "prompt": "x"}, "unknown field")]:
        status, answer = post(base_url, path, body)
        assert status in (400, 404) and words in answer["error"]["message"], (body, answer)


def test_model_card_by_id(base_url: str, client: Any) -> None:
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.object == "model"
    assert card.model_dump() == client.models.list().data[0].model_dump()
    with pytest.raises(openai.NotFoundError, match=f"`{MODEL}`"):
        client.models.retrieve("Qwen/Qwen3-0.6B")  # a hub id: a slash in the path
    status, answer = fetch("GET", f"{base_url}/v1/models/other")
    assert status == 404 and json.loads(answer)["error"]["code"] == 404


# ---------------------------------------------------------------------------- fields
NOT_YET: list[tuple[str, object]] = []  # every field both routes share is served
NEUTRAL = [("presence_penalty", 0), ("frequency_penalty", 0.0), ("repetition_penalty", 1),
           ("min_p", 0), ("logit_bias", {}), ("min_tokens", 0), ("stop_token_ids", []),
           ("response_format", {"type": "text"}), ("n", 1), ("user", "someone"),
           ("logprobs", None)]


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_fields_not_supported_yet_are_400s_in_both_endpoints(base_url: str, chat: bool) -> None:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    base: dict[str, Any] = ({"messages": [{"role": "user", "content": "Hi"}]} if chat
                            else {"prompt": "Hi"})
    only_here = [] if chat else [("best_of", 2), ("suffix", "x")]
    for name, value in NOT_YET + only_here:
        status, answer = post(base_url, path, {**base, name: value, "max_tokens": 2})
        error = answer["error"]
        assert status == 400 and error["param"] == name, (name, answer)
        assert error["message"].startswith(f"not supported yet: {name} (allowed: "), answer
    for name, value in NEUTRAL:
        status, answer = post(base_url, path, {**base, name: value, "max_tokens": 2})
        assert status == 200, (name, answer)
    status, answer = post(base_url, path, {**base, "guided_decoding_backend": "xgrammar"})
    assert status == 400
    message = answer["error"]["message"]
    assert "guided_decoding_backend: unknown field (allowed: " in message
    assert "min_p, min_tokens" in message  # the fields allowed, listed
    # A field not implemented yet is listed with the only values it takes.
    assert ("suffix (only null)" in message) != chat  # a completions field
    assert ("best_of (only 1 or null)" in message) != chat


def test_the_openai_client_sees_which_field_is_refused(client: Any) -> None:
    with pytest.raises(openai.BadRequestError, match="not supported yet: best_of "):
        client.completions.create(model=MODEL, prompt="Hi", best_of=2)
    # Tools without the server's flags: vLLM's 400, naming the flags to pass.
    with pytest.raises(openai.BadRequestError, match='"auto" tool choice requires '
                                                     "--enable-auto-tool-choice"):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], stream=True,
            tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])


@pytest.mark.parametrize("max_tokens", [10**30, 2**63, MAX_MODEL_LENGTH])
def test_max_tokens_beyond_the_context_is_a_400_with_the_numbers(client: Any,
                                                                 max_tokens: int) -> None:
    prompt = "Hello"  # 5 tokens
    words = (f"max_tokens={max_tokens}: allowed: at most {MAX_MODEL_LENGTH - 5} beside a prompt "
             f"of 5 tokens (prompt + max_tokens <= max_model_length={MAX_MODEL_LENGTH})")
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError, match=re.escape(words)):
            client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                      stream=stream)
    messages = [{"role": "user", "content": prompt}]
    with pytest.raises(openai.BadRequestError, match=f"max_tokens={max_tokens}: allowed: at most"):
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens)


def test_max_tokens_that_fills_the_context_exactly_is_served(client: Any) -> None:
    prompt = "x" * (MAX_MODEL_LENGTH - 4)
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 4 and out.choices[0].finish_reason == "length"
    # Without max_tokens, the default is what is left (here 4, less than OpenAI's 16).
    out = client.completions.create(model=MODEL, prompt=prompt, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 4


# ---------------------------------------------------------------------------- the log
def test_one_log_line_per_request_with_tokens_and_refusal_reasons(base_url: str,
                                                                   client: Any) -> None:
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    request_logger = logging.getLogger("myvllm.requests")
    level = request_logger.level
    request_logger.addHandler(handler)
    request_logger.setLevel(logging.INFO)
    try:
        client.completions.create(prompt="Hello", **GREEDY)
        list(client.completions.create(prompt=PROMPTS[:2], stream=True, **GREEDY))
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=MODEL, prompt="Hi", extra_body={"best_of": 2})
        fetch("GET", f"{base_url}/nothing")
        # A line is written once its answer is sent: the client may read it a moment before.
        wait_for(lambda: len(lines) >= 4, "the fourth request's log line")
    finally:
        request_logger.removeHandler(handler)
        request_logger.setLevel(level)
    assert len(lines) == 4, lines
    assert '"POST /v1/completions HTTP/1.1" 200 prompt_tokens=5 completion_tokens=6 ' in lines[0]
    assert lines[0].startswith("127.0.0.1:") and lines[0].endswith("s")
    assert " 200 prompt_tokens=39 completion_tokens=12 " in lines[1]
    assert " 400 " in lines[2] and lines[2].endswith(": not supported yet: best_of (allowed: 1 "
                                                     "or null)")
    assert '"GET /nothing HTTP/1.1" 404' in lines[3] and lines[3].endswith(": Not Found")


# ---------------------------------------------------------------------------- HTTP details
def test_openapi_declares_every_request_body(base_url: str) -> None:
    schema = json.loads(fetch("GET", f"{base_url}/openapi.json")[1])
    components = schema["components"]["schemas"]

    def resolve(ref: dict[str, Any]) -> dict[str, Any]:
        return components[ref["$ref"].rsplit("/", 1)[1]]

    posts = {path: ops["post"] for path, ops in schema["paths"].items() if "post" in ops}
    assert set(posts) == {"/v1/completions", "/v1/chat/completions", "/tokenize",
                          "/detokenize"}
    for path, op in posts.items():
        body = op["requestBody"]["content"]["application/json"]["schema"]
        for ref in body.get("anyOf", [body]):
            assert resolve(ref)["properties"], path
    completion = resolve(posts["/v1/completions"]["requestBody"]["content"][
        "application/json"]["schema"])
    assert completion["required"] == ["prompt"] and "max_tokens" in completion["properties"]
    # Nested models resolve too (ChatMessage inside the chat request).
    chat = json.dumps(components["ChatCompletionRequest"])
    for name in ("ChatMessage", "StreamOptions", "ResponseFormat", "ContentPart"):
        assert name in components, name
    assert "#/components/schemas/ChatMessage" in chat


def test_health_is_plain_text(base_url: str) -> None:
    import urllib.request

    with urllib.request.urlopen(f"{base_url}/health", timeout=30) as response:
        assert response.status == 200
        assert response.headers["content-type"].startswith("text/plain")
        assert response.read() == b"ok\n"


def test_connection_timeouts_are_set() -> None:
    """What make_server gives uvicorn (the values docs/serving.md gives and explains)."""
    config = openai_server.uvicorn_config(None, "127.0.0.1", 0, "warning")
    assert config.timeout_keep_alive == 5
    assert config.timeout_request_head == 20.0
    assert config.h11_max_incomplete_event_size == 16 * 1024
    assert config.http is H11WithHeadDeadline and not config.access_log


def test_idle_and_half_sent_heads_are_closed_after_the_deadline() -> None:
    """The deadline at work on a bare app (no engine): a connection that sends nothing, or
    half a request head, is closed; one that sends its request is answered, then kept alive
    until the deadline again."""
    import uvicorn

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    sock = free_socket()
    config = DeadlineConfig(app, timeout_request_head=0.3, log_level="warning",
                            timeout_keep_alive=30, lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    address = sock.getsockname()
    try:
        def closed_within(connection: socket.socket, seconds: float) -> bool:
            connection.settimeout(seconds)
            data = b""
            while True:
                chunk = connection.recv(4096)
                if not chunk:
                    return True
                data += chunk

        with socket.create_connection(address) as idle, \
                socket.create_connection(address) as half, \
                socket.create_connection(address) as served:
            half.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")
            served.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            served.settimeout(10)
            assert served.recv(4096).startswith(b"HTTP/1.1 200")
            # Generous bounds: the deadline is 0.3 s; "closed" is what is checked.
            assert closed_within(idle, 10) and closed_within(half, 10)
            assert closed_within(served, 10)  # the kept-alive one, idle after its answer
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()

