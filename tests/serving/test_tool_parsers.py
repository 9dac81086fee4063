"""The tool-call and reasoning parsers on outputs in each model's format, whole and streamed.

The outputs are written in each model's format (Qwen3's <think> and <tool_call>, Llama 3's
JSON with and without <|python_tag|>), with their spacing and newlines; the bundled SmolLM2's
are recorded from it. Streamed, each output
is cut into pieces of every size from 1 character up (so every tag is split at every place),
and the deltas must add up to the non-streamed answer: the same content, reasoning, names and
arguments, each call's id and name sent once, in its first delta.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from myvllm.entrypoints.chat_output_parsing import (ChatOutputParsing, ChatOutputSettings,
                                                    output_parsing)
from myvllm.entrypoints.protocol import ChatCompletionRequest
from myvllm.entrypoints.reasoning_parsers import ReasoningParserManager, ReasoningStream
from myvllm.entrypoints.tool_parsers import ToolCallStream, ToolParserManager
from myvllm.entrypoints.tool_parsers.tool_choice import (NamedFunctionParser,
                                                         RequiredToolParser, required_schema)

QWEN3_ONE_CALL = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
                  '"unit": "celsius"}}\n</tool_call>')
QWEN3_TWO_CALLS = ('I will look both up.\n<tool_call>\n{"name": "get_weather", "arguments": '
                   '{"city": "Paris"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", '
                   '"arguments": {"zone": "Europe/Paris", "formats": ["24h", {"x": "}\\""}]}}'
                   '\n</tool_call>')
QWEN3_NO_CALL = "The weather in Paris is sunny, 21 degrees <tool-ish> text."
QWEN3_BAD_JSON = '<tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}}\n</tool_call>'
QWEN3_UNCLOSED = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
QWEN3_CUT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'
QWEN3_THINKING = ("<think>\nThe user asks for the weather in Paris; I have a tool for it.\n"
                  "</think>\n\n" + QWEN3_ONE_CALL)
# Recorded: the bundled SmolLM2-135M's greedy answers (80 tokens) to two questions with
# get_weather shown by examples/tool_chat_template_chatml.jinja; a 135M model calls no tool
# by itself (hence tool_choice "required" or named for it): content, all of it.
SMOLLM2_ANSWERS = [
    "The weather in Paris is described as a mix of warm and cool. Paris is known for its "
    "beautiful Parisian nightlife, with a wide range of attractions, from the iconic Eiffel "
    "Tower to the world-famous Louvre Museum. The city is also famous for its art and culture, "
    "with numerous museums and galleries dedicated to the arts and culture.\n\nThe weather "
    "in Paris is also known for",
    "```javascript\nfunction get_weather(city) {\n  return {\n    type: \"function\",\n    "
    "name: \"get_weather\",\n    description: \"The weather in London.\",\n    parameters: "
    "{\n      city: {\n        type: \"string\",\n        required: [\"city\"]\n      },\n"
    "    },\n    required: [\"city\"]\n  };\n}\n```\n\nThis function"]
LLAMA3_ONE_CALL = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
LLAMA3_TAGGED = ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
                 '{"name": "get_time", "parameters": {}}')
LLAMA3_TEXT = "Paris is sunny today."


def assemble(deltas: list[dict[str, Any]]) -> dict[str, Any]:
    """The streamed deltas added up, as OpenAI's clients do; checks each call's first delta
    carries its id, type and name, and no later one does."""
    content, reasoning = "", ""
    calls: dict[int, dict[str, Any]] = {}
    for delta in deltas:
        content += delta.get("content", "")
        reasoning += delta.get("reasoning_content", "")
        for entry in delta.get("tool_calls", []):
            index = entry["index"]
            if index not in calls:
                assert entry["id"].startswith("call_") and entry["type"] == "function", entry
                assert index == len(calls), "calls come in order"
                calls[index] = {"id": entry["id"], "name": entry["function"]["name"],
                                "arguments": ""}
            else:
                assert "id" not in entry and "name" not in entry["function"], entry
            calls[index]["arguments"] += entry["function"].get("arguments", "")
    return {"content": content, "reasoning": reasoning,
            "calls": [calls[i] for i in sorted(calls)]}


def pieces(text: str, size: int) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)] or [""]


def streamed_tool_calls(parser_name: str, text: str, size: int) -> dict[str, Any]:
    stream = ToolCallStream(ToolParserManager.get(parser_name)())
    parts = pieces(text, size)
    return assemble([stream.delta(p, final=i == len(parts) - 1) for i, p in enumerate(parts)])


def whole(parser_name: str, text: str) -> tuple[str | None, list[tuple[str, str]]]:
    info = ToolParserManager.get(parser_name)().extract_tool_calls(text)
    assert info.tools_called == bool(info.tool_calls)
    for call in info.tool_calls:
        assert call["id"].startswith("call_") and call["type"] == "function"
    return info.content, [(c["function"]["name"], c["function"]["arguments"])
                          for c in info.tool_calls]


def test_hermes_reads_qwen3_calls() -> None:
    assert whole("hermes", QWEN3_ONE_CALL) == (
        None, [("get_weather", '{"city": "Paris", "unit": "celsius"}')])
    content, calls = whole("hermes", QWEN3_TWO_CALLS)
    assert content == "I will look both up.\n"
    assert [name for name, _ in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[1][1]) == {"zone": "Europe/Paris", "formats": ["24h", {"x": '}"'}]}
    assert whole("hermes", QWEN3_UNCLOSED) == (None, [("get_weather", '{"city": "Paris"}')])


@pytest.mark.parametrize("text", [QWEN3_NO_CALL, QWEN3_BAD_JSON, QWEN3_CUT, "",
                                  *SMOLLM2_ANSWERS])
def test_hermes_without_a_valid_call_is_all_content(text: str) -> None:
    assert whole("hermes", text) == (text, [])
    assert streamed_tool_calls("hermes", text, 3)["content"] == (
        text if "<tool_call>" not in text else text[:text.index("<tool_call>")])


@pytest.mark.parametrize("parser, text", [
    ("hermes", QWEN3_ONE_CALL), ("hermes", QWEN3_TWO_CALLS), ("hermes", QWEN3_NO_CALL),
    ("hermes", QWEN3_UNCLOSED), ("llama3_json", LLAMA3_ONE_CALL),
    ("llama3_json", LLAMA3_TAGGED), ("llama3_json", LLAMA3_TEXT)])
def test_streamed_deltas_add_up_to_the_whole_answer(parser: str, text: str) -> None:
    content, calls = whole(parser, text)
    for size in range(1, len(text) + 1):
        streamed = streamed_tool_calls(parser, text, size)
        assert [(c["name"], c["arguments"]) for c in streamed["calls"]] == calls, size
        assert streamed["content"] == ((content or "") if calls else text), size
        assert len({c["id"] for c in streamed["calls"]}) == len(calls)


def test_a_tag_split_across_pieces_is_held_back_not_sent_as_content() -> None:
    stream = ToolCallStream(ToolParserManager.get("hermes")())
    assert stream.delta("Sure.<tool") == {"content": "Sure."}
    assert stream.delta("_ca") == {}
    assert stream.delta("ll>\n{\"name\": \"f\"") == {"tool_calls": [
        {"index": 0, "id": stream.calls[0].id, "type": "function", "function": {"name": "f"}}]}
    # Not a tag after all: the held-back text is content.
    other = ToolCallStream(ToolParserManager.get("hermes")())
    assert other.delta("a <tool") == {"content": "a "}
    assert other.delta("s>") == {"content": "<tools>"}
    assert other.delta("<to", final=True) == {"content": "<to"}


def test_llama3_json_reads_calls_and_leaves_text() -> None:
    assert whole("llama3_json", LLAMA3_ONE_CALL) == (None, [("get_weather",
                                                             '{"city": "Paris"}')])
    assert whole("llama3_json", LLAMA3_TAGGED) == (
        None, [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")])
    assert whole("llama3_json", LLAMA3_TEXT) == (LLAMA3_TEXT, [])
    assert whole("llama3_json", '{"name": "f", "parameters": {"a": 1}} trailing') == (
        '{"name": "f", "parameters": {"a": 1}} trailing', [])


def test_unknown_parsers_are_refused_with_the_names_allowed() -> None:
    with pytest.raises(ValueError, match=r"unknown tool call parser 'mistral' \(allowed: "
                                         r"hermes, llama3_json\)"):
        ToolParserManager.get("mistral")
    with pytest.raises(ValueError, match=r"--reasoning-parser: unknown reasoning parser "
                                         r"'deepseek_r1' \(allowed: qwen3\)"):
        ChatOutputSettings(reasoning_parser="deepseek_r1").check()
    with pytest.raises(ValueError, match="--enable-auto-tool-choice needs --tool-call-parser"):
        ChatOutputSettings(enable_auto_tool_choice=True).check()


# ------------------------------------------------------------------ forced calls
def test_named_and_required_answers_are_read_as_calls() -> None:
    named = NamedFunctionParser("get_weather")
    info = named.extract_tool_calls('{"city":"Paris"}')
    assert [c["function"] for c in info.tool_calls] == [
        {"name": "get_weather", "arguments": '{"city":"Paris"}'}]
    required = '[{"name":"get_weather","parameters":{"city":"Paris"}},{"name":"f","parameters":{}}]'
    info = RequiredToolParser().extract_tool_calls(required)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in info.tool_calls] == [
        ("get_weather", '{"city":"Paris"}'), ("f", "{}")]
    for size in range(1, len(required) + 1):
        stream = ToolCallStream(RequiredToolParser())
        parts = pieces(required, size)
        streamed = assemble([stream.delta(p, i == len(parts) - 1) for i, p in enumerate(parts)])
        assert [(c["name"], c["arguments"]) for c in streamed["calls"]] == [
            ("get_weather", '{"city":"Paris"}'), ("f", "{}")]


def test_required_schema_lists_every_tool_and_one_call_without_parallel_calls() -> None:
    tools = [{"type": "function", "function": {"name": "a", "parameters": {"type": "object"}}},
             {"type": "function", "function": {"name": "b"}}]
    schema = required_schema(tools, parallel_tool_calls=False)
    assert schema["maxItems"] == 1 and schema["minItems"] == 1
    names = [c["properties"]["name"]["enum"] for c in schema["items"]["anyOf"]]
    assert names == [["a"], ["b"]]
    assert schema["items"]["anyOf"][1]["properties"]["parameters"] == {
        "type": "object", "properties": {}}


# ------------------------------------------------------------------ reasoning
def split(text: str) -> tuple[str | None, str]:
    parsed = ReasoningParserManager.get("qwen3")().split(text, final=True)
    return parsed.reasoning, parsed.content


def test_qwen3_reasoning_is_split_from_the_answer() -> None:
    assert split("<think>\nLet me see.\n</think>\n\nParis.") == ("\nLet me see.\n", "Paris.")
    assert split("Paris.") == (None, "Paris.")  # enable_thinking false: no <think>
    assert split("<think>\nStill thinking wh") == ("\nStill thinking wh", "")  # cut short
    assert split("<think></think>Paris.") == ("", "Paris.")


@pytest.mark.parametrize("text", ["<think>\nLet me see.\n</think>\n\nParis.", "Paris.",
                                  "<think>\nStill thinking </thi", "<thin", "<b>bold</b>"])
def test_qwen3_reasoning_streamed_adds_up(text: str) -> None:
    reasoning, content = split(text)
    for size in range(1, len(text) + 1):
        stream = ReasoningStream(ReasoningParserManager.get("qwen3")())
        parts = pieces(text, size)
        got = [stream.delta(p, i == len(parts) - 1) for i, p in enumerate(parts)]
        assert "".join(r for r, _ in got) == (reasoning or ""), size
        assert "".join(c for _, c in got) == content, size


def chat_request(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate_json(json.dumps(
        {"messages": [{"role": "user", "content": "Weather in Paris?"}], **fields}))


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]


def test_reasoning_then_tool_calls_whole_and_streamed() -> None:
    parsing = output_parsing(chat_request(tools=TOOLS), ChatOutputSettings(
        True, "hermes", "qwen3"))
    assert isinstance(parsing, ChatOutputParsing)
    message, finish_reason = parsing.message(QWEN3_THINKING, "stop")
    assert finish_reason == "tool_calls"
    assert message["reasoning_content"].startswith("\nThe user asks")
    assert message["content"] is None
    assert message["tool_calls"][0]["function"]["name"] == "get_weather"
    for size in (1, 3, 11):
        stream = parsing.stream()
        parts = pieces(QWEN3_THINKING, size)
        streamed = assemble([stream.delta(p, i == len(parts) - 1) for i, p in enumerate(parts)])
        assert streamed["reasoning"] == message["reasoning_content"]
        assert streamed["content"] == ""
        assert [(c["name"], c["arguments"]) for c in streamed["calls"]] == [
            (c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
        assert stream.finish_reason("stop") == "tool_calls"


def test_an_answer_cut_while_thinking_has_no_content() -> None:
    parsing = output_parsing(chat_request(), ChatOutputSettings(reasoning_parser="qwen3"))
    assert parsing is not None
    assert parsing.message("<think>\nHmm, the user", "length") == (
        {"role": "assistant", "content": None, "reasoning_content": "\nHmm, the user"},
        "length")
    assert parsing.message("Paris.", "stop") == (
        {"role": "assistant", "content": "Paris.", "reasoning_content": None}, "stop")


def test_how_each_tool_choice_is_read() -> None:
    settings = ChatOutputSettings(True, "hermes")
    assert output_parsing(chat_request(), settings) is None  # no tools: plain text
    assert output_parsing(chat_request(tools=TOOLS, tool_choice="none"), settings) is None
    named = output_parsing(chat_request(tools=TOOLS, tool_choice={
        "type": "function", "function": {"name": "get_weather"}}), None)
    assert named is not None
    message, finish_reason = named.message('{"city": "Paris"}', "stop")
    assert finish_reason == "stop"  # a named function's answer keeps its own (vLLM, OpenAI)
    assert message["tool_calls"][0]["function"] == {"name": "get_weather",
                                                    "arguments": '{"city": "Paris"}'}
    required = output_parsing(chat_request(tools=TOOLS, tool_choice="required"), None)
    assert required is not None
    assert required.message('[{"name": "get_weather", "parameters": {"city": "Oslo"}}]',
                            "stop")[1] == "tool_calls"
    one = output_parsing(chat_request(tools=TOOLS, parallel_tool_calls=False), settings)
    assert one is not None
    assert len(one.message(QWEN3_TWO_CALLS, "stop")[0]["tool_calls"]) == 1
