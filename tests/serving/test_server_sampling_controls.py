"""The sampling controls through the server, with the official openai client.

test_server.py's server (conftest.py): the tiny random Qwen3 with a byte-level tokenizer
(token i = byte i; eos = token 0). The oracle for each field is LLM.generate on the same
checkpoint with the SamplingParams the field maps to (the engine's own tests check those
against transformers): the same prompt ids, seeded sampling, the same tokens. Streaming gives
the same text. Bad values are 400s naming the field (test_server_faults.py sends many more).
"""

from __future__ import annotations

from typing import Any

import pytest

openai = pytest.importorskip("openai")

from test_server import MODEL, SERVED  # noqa: E402

from myvllm import LLM, SamplingParams  # noqa: E402

PROMPT = list(b"Hello there")
# Hot, so that the random model's wide margins leave each control something to change.
SAMPLED: dict[str, Any] = dict(max_tokens=8, temperature=5.0, seed=3)
FORCED = ord("A")

# request field -> (its value in the request, the SamplingParams fields it maps to)
FIELDS = [
    ("presence_penalty", 2.0, dict(presence_penalty=2.0)),
    ("frequency_penalty", 2.0, dict(frequency_penalty=2.0)),
    ("repetition_penalty", 3.0, dict(repetition_penalty=3.0)),
    ("min_p", 0.3, dict(min_p=0.3)),
    ("logit_bias", {str(FORCED): 100}, dict(logit_bias={FORCED: 100.0})),
    ("min_tokens", 5, dict(min_tokens=5, logit_bias={0: 100.0})),  # eos held back for 5
    ("stop_token_ids", [FORCED], dict(stop_token_ids=[FORCED], logit_bias={FORCED: 100.0})),
]


@pytest.fixture(scope="module")
def client(base_url: str) -> Any:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def llm(base_url: str) -> LLM:
    return LLM(SERVED["llm"].model_path, max_model_length=256)


def extra(field: str, value: Any, params: dict[str, Any]) -> dict[str, Any]:
    """The request's fields: the one under test, plus the bias its check needs."""
    body = {field: value}
    if field in ("min_tokens", "stop_token_ids"):
        bias = {str(t): b for t, b in params["logit_bias"].items()}
        body["logit_bias"] = bias
    return body


@pytest.mark.parametrize("field, value, params", FIELDS, ids=[f[0] for f in FIELDS])
def test_each_field_samples_as_the_engine_does(client: Any, llm: LLM, field: str, value: Any,
                                               params: dict[str, Any]) -> None:
    [expected] = llm.generate([PROMPT], SamplingParams(**SAMPLED, **params), use_tqdm=False)
    plain = llm.generate([PROMPT], SamplingParams(**SAMPLED), use_tqdm=False)[0]
    assert expected["token_ids"] != plain["token_ids"]  # the field changes the answer
    body = extra(field, value, params)
    answer = client.completions.create(model=MODEL, prompt=PROMPT, **SAMPLED, extra_body=body)
    assert answer.choices[0].text == expected["text"]
    stream = client.completions.create(model=MODEL, prompt=PROMPT, **SAMPLED, extra_body=body,
                                       stream=True)
    assert "".join(chunk.choices[0].text for chunk in stream) == expected["text"]


def test_stop_token_ids_finish_with_stop_and_leave_the_token_out(client: Any) -> None:
    body = {"stop_token_ids": [FORCED], "logit_bias": {str(FORCED): 100}, "min_tokens": 2,
            "ignore_eos": True}
    answer = client.completions.create(model=MODEL, prompt="Hi", max_tokens=10,
                                       temperature=0, extra_body=body)
    choice = answer.choices[0]
    assert choice.finish_reason == "stop" and len(choice.text) == 2 and "A" not in choice.text
    assert answer.usage.completion_tokens == 3  # the stop token counts, as in vLLM
    messages = [{"role": "user", "content": "Hi"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10,
                                          temperature=0, extra_body=body)
    assert chat.choices[0].finish_reason == "stop" and len(chat.choices[0].message.content) == 2
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages,
                                                 max_tokens=10, temperature=0,
                                                 extra_body=body, stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == chat.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_chat_takes_openais_penalties_and_logit_bias(client: Any) -> None:
    messages = [{"role": "user", "content": "Say something"}]
    answer = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=5, temperature=0.7, presence_penalty=1.0,
        frequency_penalty=0.5, logit_bias={str(FORCED): 100}, extra_body={"ignore_eos": True})
    assert answer.choices[0].message.content == "A" * 5


@pytest.mark.parametrize("field, value, words", [
    ("logit_bias", {"65": 101}, "logit_bias['65']=101.0: allowed: a number in [-100, 100]"),
    ("logit_bias", {"x": 1}, "logit_bias key='x': allowed: a token id"),
    ("logit_bias", {"256": 1}, "SamplingParams.logit_bias: token id=256: allowed: a token id "
                               "of the vocabulary, [0, 256)"),
    ("stop_token_ids", [300], "SamplingParams.stop_token_ids: token id=300: allowed:"),
    ("stop", ["a", ""], "stop[1]='': allowed: a string of at least 1 character"),
    ("stop", ["a"] * 65, "len(stop)=65: allowed: at most 64 stop strings"),
    ("stop", ["a", "b" * 257], "len(stop[1])=257: allowed: at most 256 characters"),
    ("min_tokens", 9, "SamplingParams.min_tokens=9: allowed: an int in [0, max_tokens = 8]"),
    ("presence_penalty", 2.5, "presence_penalty"),
])
def test_bad_values_are_400s_that_say_why(client: Any, field: str, value: Any,
                                          words: str) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=8,
                                  extra_body={field: value})
    assert words in str(refused.value)
