"""Structured outputs through the server, with the official openai client: OpenAI's
response_format (json_schema, json_object) in chat, vLLM's guided_choice / guided_regex /
structured_outputs in /v1/completions (as extra_body), streamed and not, and the 400s.

test_server.py's server (conftest.py): the tiny random Qwen3 with a byte-level tokenizer. A
random model follows no instruction, so a valid answer is the grammar's doing.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

openai = pytest.importorskip("openai")

import jsonschema  # noqa: E402
from test_server import MODEL, fetch  # noqa: E402

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "ok"],
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "ok": {"type": "boolean"},
                         "kind": {"enum": ["cat", "dog"]}}}
MESSAGES = [{"role": "user", "content": "Describe a pet as JSON."}]


@pytest.fixture(scope="module")
def client(base_url: str) -> Any:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


# Few places for whitespace (at most 16 characters each, structured_output/manager.py): a
# random model's answer ends within max_tokens, whitespace and all.
SMALL_SCHEMA = {"type": "object", "required": ["kind", "ok"], "additionalProperties": False,
                "properties": {"kind": {"enum": ["cat", "dog"]}, "ok": {"type": "boolean"}}}


def test_chat_response_format_json_schema(client: Any) -> None:
    for seed in range(3):
        answer = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=200, temperature=1.0, seed=seed,
            response_format={"type": "json_schema", "json_schema": {
                "name": "pet", "schema": SMALL_SCHEMA, "strict": True}})
        choice = answer.choices[0]
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), SMALL_SCHEMA)


def test_chat_json_object_streamed(client: Any) -> None:
    """Any object: a random model may not close it within max_tokens; those that stop
    parse as an object, the others are its beginning."""
    for seed in range(3):
        chunks = list(client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=200, temperature=1.0, seed=seed,
            response_format={"type": "json_object"}, stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
        if reasons[-1] == "stop":
            assert isinstance(json.loads(text), dict), text
        else:
            assert reasons[-1] == "length" and text.lstrip().startswith("{"), text


def test_completions_guided_choice_regex_and_structured_outputs(client: Any) -> None:
    choices = ["red", "green", "blue"]
    answer = client.completions.create(model=MODEL, prompt=["a", "b", "c"], max_tokens=20,
                                       temperature=1.0, seed=1,
                                       extra_body={"guided_choice": choices})
    assert all(c.text in choices and c.finish_reason == "stop" for c in answer.choices)
    stream = client.completions.create(model=MODEL, prompt="Phone:", max_tokens=30,
                                       temperature=1.0, seed=2, stream=True,
                                       extra_body={"guided_regex": r"\d{3}-\d{4}"})
    text = "".join(chunk.choices[0].text for chunk in stream)
    assert re.fullmatch(r"\d{3}-\d{4}", text), text
    answer = client.completions.create(
        model=MODEL, prompt="JSON:", max_tokens=150, temperature=0.0,
        extra_body={"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}})
    value = json.loads(answer.choices[0].text)
    jsonschema.validate(value, SCHEMA)
    assert answer.choices[0].text == json.dumps(value, separators=(", ", ": "),
                                                ensure_ascii=False)


def test_bad_constraints_are_400s(base_url: str) -> None:
    def post(body: dict[str, Any]) -> tuple[int, str]:
        status, raw = fetch("POST", f"{base_url}/v1/completions",
                            json.dumps({"prompt": "x", "max_tokens": 5, **body}).encode())
        return status, json.loads(raw)["error"]["message"]

    for body, message in [
            ({"guided_regex": "(unclosed"}, "regex cannot be compiled"),
            ({"guided_json": {"type": "nonsense"}}, 'Unsupported type "nonsense"'),
            ({"guided_choice": ["a"], "guided_regex": "a"},
             "at most one structured output constraint per request, got guided_regex, "
             "guided_choice"),
            ({"response_format": {"type": "json_object"}, "ignore_eos": True},
             "ignore_eos=True does not combine with structured_outputs"),
            ({"response_format": {"type": "json_schema"}}, '"json_schema" goes with type'),
            ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one of")]:
        status, error = post(body)
        assert status == 400 and message in error, (body, error)
