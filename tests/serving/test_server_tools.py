"""Tool calling and reasoning through the server, with the official openai client.

Two servers of the tiny random Qwen3 (byte-level tokenizer): test_server.py's (conftest.py:
started without the tool flags) and one of this module's, started as
`myvllm serve --enable-auto-tool-choice --tool-call-parser hermes --reasoning-parser qwen3
--chat-template T` with a template that writes the tools' names and a chat_template_kwargs
value into the prompt (so usage.prompt_tokens, a byte count, shows what reached it).

A random model follows no instruction, so the calls it makes are the grammar's doing: the
forced calls (tool_choice "required" or a named function) by the schema of the call, the
"auto" calls and the <think> answers by a guided_regex that spells the format the parsers read.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

openai = pytest.importorskip("openai")

import jsonschema  # noqa: E402
from test_server import (CHAT_TEMPLATE, MAX_MODEL_LENGTH, MODEL, fetch,  # noqa: E402
                         served_in_thread, tiny_chat_checkpoint)

from myvllm.entrypoints.chat_output_parsing import AUTO_NEEDS_FLAGS, ChatOutputSettings  # noqa: E402,E501

CITY = {"type": "string", "enum": ["Paris", "Oslo", "Lima"]}
TOOLS = [{"type": "function", "function": {
              "name": "get_weather", "description": "The weather in a city.",
              "parameters": {"type": "object", "properties": {"city": CITY},
                             "required": ["city"], "additionalProperties": False}}},
         {"type": "function", "function": {"name": "get_time"}}]  # no parameters
NAMED = {"type": "function", "function": {"name": "get_weather"}}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
# The template of this module's server: the tools' names and a greeting, when given.
TEMPLATE = ("{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}"
            "</tools>{% endif %}{% if greeting is defined %}{{ greeting }}{% endif %}"
            + CHAT_TEMPLATE)
HERMES_REGEX = (r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Oslo)"'
                r'\}\}\n</tool_call>')


@pytest.fixture(scope="module")
def client(base_url: str) -> Any:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tools_client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from myvllm import Config
    from myvllm.serving.async_llm import AsyncLLM

    path = tiny_chat_checkpoint(tmp_path_factory.mktemp("tiny_tools"))
    llm = AsyncLLM(Config(model=str(path), num_kvcache_blocks=64,
                          max_model_length=MAX_MODEL_LENGTH, max_num_sequences=8))
    settings = ChatOutputSettings(enable_auto_tool_choice=True, tool_call_parser="hermes",
                                  reasoning_parser="qwen3")
    with served_in_thread(llm, MODEL, log_level="warning", chat_template=TEMPLATE,
                          chat_outputs=settings) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def post(base_url: str, body: dict[str, Any]) -> tuple[int, Any]:
    status, answer = fetch("POST", f"{base_url}/v1/chat/completions", json.dumps(body).encode())
    return status, json.loads(answer)


def streamed_calls(chunks: list[Any]) -> tuple[dict[int, dict[str, str]], list[str | None]]:
    """The calls a stream's deltas add up to (by index), and its finish reasons."""
    calls: dict[int, dict[str, str]] = {}
    for chunk in chunks:
        for call in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            if call.index not in calls:
                assert call.id.startswith("call_") and call.type == "function"
                calls[call.index] = {"id": call.id, "name": call.function.name,
                                     "arguments": ""}
            else:
                assert call.id is None and call.function.name is None
            calls[call.index]["arguments"] += call.function.arguments or ""
    return calls, [c.choices[0].finish_reason for c in chunks if c.choices]


# ------------------------------------------------------------ forced calls (no flags needed)
def test_a_named_function_is_called_with_valid_arguments(client: Any) -> None:
    for seed in range(3):
        answer = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=NAMED, max_tokens=60,
            temperature=1.0, seed=seed)
        choice = answer.choices[0]
        assert choice.finish_reason == "stop", choice  # vLLM's and OpenAI's for a named one
        (call,) = choice.message.tool_calls
        assert call.id.startswith("call_") and call.type == "function"
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments),
                            TOOLS[0]["function"]["parameters"])


def test_required_calls_one_of_the_tools_streamed_and_not(client: Any) -> None:
    for seed in range(3):
        answer = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required",
            parallel_tool_calls=False, max_tokens=80, temperature=1.0, seed=seed)
        choice = answer.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        (call,) = choice.message.tool_calls
        assert call.function.name in ("get_weather", "get_time")
        arguments = json.loads(call.function.arguments)
        if call.function.name == "get_weather":
            jsonschema.validate(arguments, TOOLS[0]["function"]["parameters"])
        else:
            assert arguments == {}
        chunks = list(client.chat.completions.create(
            model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required",
            parallel_tool_calls=False, max_tokens=80, temperature=1.0, seed=seed, stream=True))
        calls, reasons = streamed_calls(chunks)
        assert reasons[-1] == "tool_calls"
        assert [(c["name"], c["arguments"]) for c in calls.values()] == [
            (call.function.name, call.function.arguments)]  # the same seed, the same call


def test_named_function_streamed_sends_the_name_once_then_arguments(client: Any) -> None:
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=NAMED, max_tokens=60,
        temperature=1.0, seed=4, stream=True))
    calls, reasons = streamed_calls(chunks)
    assert reasons[-1] == "stop" and list(calls) == [0]
    assert calls[0]["name"] == "get_weather"
    jsonschema.validate(json.loads(calls[0]["arguments"]), TOOLS[0]["function"]["parameters"])


def test_tool_choice_none_ignores_the_tools(client: Any, base_url: str) -> None:
    status, answer = post(base_url, {"messages": MESSAGES, "tools": TOOLS,
                                     "tool_choice": "none", "max_tokens": 5})
    assert status == 200, answer
    assert "tool_calls" not in answer["choices"][0]["message"]


def test_tool_results_are_fed_back_through_the_template(client: Any) -> None:
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    answer = client.chat.completions.create(model=MODEL, max_tokens=5, messages=[
        *MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}])
    assert answer.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("fields, words", [
    ({"tools": TOOLS}, AUTO_NEEDS_FLAGS),  # tools alone mean "auto"
    ({"tools": TOOLS, "tool_choice": "auto"}, AUTO_NEEDS_FLAGS),
    ({"tool_choice": "required"}, "When using `tool_choice`, `tools` must be set."),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice names the function 'nope', which is not one of the tools (allowed: "
     "get_weather, get_time)"),
    ({"tools": TOOLS, "tool_choice": "sometimes"},
     "tool_choice.mode: Input should be 'none', 'auto' or 'required'"),
    ({"tools": [{"type": "function", "function": {"name": "f", "args": {}}}],
      "tool_choice": "none"}, "tools.0.function.args: unknown field (allowed: description, "
                              "name, parameters, strict)"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice required constrains the answer to a call, so it takes no other"),
    ({"messages": [*MESSAGES, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]},
     "the arguments of a call of 'f' are not JSON"),
])
def test_tool_mistakes_are_400s_that_say_what_to_do(base_url: str, fields: dict[str, Any],
                                                    words: str) -> None:
    status, answer = post(base_url, {"messages": MESSAGES, "max_tokens": 5, **fields})
    assert status == 400, answer
    assert words in answer["error"]["message"], answer


# ------------------------------------------------------------ a server with the flags
def test_auto_reads_the_models_tool_call(tools_client: Any) -> None:
    answer = tools_client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=100, temperature=1.0, seed=1,
        extra_body={"guided_regex": HERMES_REGEX})
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Oslo")
    chunks = list(tools_client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=100, temperature=1.0, seed=1,
        extra_body={"guided_regex": HERMES_REGEX}, stream=True))
    calls, reasons = streamed_calls(chunks)
    assert reasons[-1] == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        ("get_weather", call.function.arguments)]


def test_auto_without_a_call_is_content(tools_client: Any) -> None:
    answer = tools_client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=8,
        extra_body={"guided_regex": "[a-z]{3,6}"})
    choice = answer.choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert choice.message.content.isalpha()


def test_reasoning_content_whole_and_streamed(tools_client: Any) -> None:
    regex = "<think>[a-z]{2,8}</think>[A-Z]{2,8}"
    answer = tools_client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=40, temperature=1.0, seed=3,
        extra_body={"guided_regex": regex})
    message = answer.model_dump()["choices"][0]["message"]
    assert message["reasoning_content"].isalpha() and message["reasoning_content"].islower()
    assert message["content"].isalpha() and message["content"].isupper()
    chunks = list(tools_client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=40, temperature=1.0, seed=3,
        extra_body={"guided_regex": regex}, stream=True))
    deltas = [c.model_dump()["choices"][0]["delta"] for c in chunks if c.choices]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == (
        message["reasoning_content"])
    assert "".join(d.get("content") or "" for d in deltas) == message["content"]


def test_tools_and_chat_template_kwargs_reach_the_template(tools_client: Any) -> None:
    def prompt_tokens(**fields: Any) -> int:
        answer = tools_client.chat.completions.create(model=MODEL, messages=MESSAGES,
                                                      max_tokens=1, **fields)
        return answer.usage.prompt_tokens

    plain = prompt_tokens()
    shown = "<tools>get_weather;get_time;</tools>"  # one token a byte
    assert prompt_tokens(tools=TOOLS, tool_choice="required") == plain + len(shown)
    assert prompt_tokens(tools=TOOLS, tool_choice="none") == plain
    assert prompt_tokens(extra_body={"chat_template_kwargs": {"greeting": "Hi!"}}) == plain + 3
    # /tokenize renders the tools as the chat route does (vLLM's field).
    status, answer = fetch("POST", f"{str(tools_client.base_url).removesuffix('/v1/')}/tokenize",
                           json.dumps({"messages": MESSAGES, "tools": TOOLS}).encode())
    assert status == 200 and json.loads(answer)["count"] == plain + len(shown), answer


# ------------------------------------------------------------ the bundled model, end to end
@pytest.mark.slow  # `myvllm serve` with the bundled SmolLM2 (minutes to load on a 2-core CPU)
def test_openai_client_round_trip_on_the_bundled_model() -> None:
    """The agent loop a function-calling client runs: the model calls a tool (forced, so a
    135M model's call is valid), the client runs it and sends the result back with the
    assistant's message as the client got it, and the model answers in text. The bundled
    model's template has no tools: the ChatML one of examples/ shows them."""
    from pathlib import Path

    from test_cli import free_port, serve_subprocess

    from myvllm.utils.model_path import bundled_model_path

    template = Path(__file__).resolve().parents[2] / "examples" / "tool_chat_template_chatml.jinja"
    port = free_port()
    with serve_subprocess([bundled_model_path(), "--served-model-name", "smollm2",
                           "--device", "cpu", "--dtype", "float32", "--max-model-length", "1024",
                           "--num-kvcache-blocks", "96", "--chat-template", str(template),
                           "--enable-auto-tool-choice", "--tool-call-parser", "hermes"],
                          port, startup_timeout_s=900):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                               max_retries=0, timeout=600)
        messages: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
        for tool_choice in (NAMED, "required"):
            first = client.chat.completions.create(
                model="smollm2", messages=messages, tools=TOOLS, tool_choice=tool_choice,
                temperature=0.0, max_tokens=60)
            (call,) = first.choices[0].message.tool_calls[:1]
            assert call.function.name == "get_weather", first
            city = json.loads(call.function.arguments)["city"]
            assert city in CITY["enum"], first
        conversation = [*messages, first.choices[0].message,  # sent back as the client got it
                        {"role": "tool", "tool_call_id": call.id,
                         "content": json.dumps({"city": city, "weather": "sunny, 21 C"})}]
        answer = client.chat.completions.create(model="smollm2", messages=conversation,
                                                tools=TOOLS, temperature=0.0, max_tokens=40)
        choice = answer.choices[0]
        assert choice.finish_reason in ("stop", "length", "tool_calls"), choice
        assert choice.message.content or choice.message.tool_calls, choice
        # The same first call, streamed: its deltas add up to the same call.
        chunks = list(client.chat.completions.create(
            model="smollm2", messages=messages, tools=TOOLS, tool_choice="required",
            temperature=0.0, max_tokens=60, stream=True))
        calls, reasons = streamed_calls(chunks)
        assert reasons[-1] == "tool_calls"
        assert [(c["name"], c["arguments"]) for c in calls.values()][:1] == [
            (call.function.name, call.function.arguments)]
