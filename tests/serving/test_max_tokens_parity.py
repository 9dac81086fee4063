"""The library and the server give the same answer for the same max_tokens: LLM.generate
raises the ValueError whose message is the server's 400 (one check each:
request_checks.check_max_tokens beside the prompt, sampling_parameters.check_max_tokens_value
below 1), and what the server serves, LLM runs.

test_server.py's server (conftest.py: the tiny Qwen3, max_model_length 256) and an LLM on the
same checkpoint with the same settings.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from test_server import MAX_MODEL_LENGTH, MODEL, SERVED, fetch

from myvllm import LLM, Config, SamplingParams

PROMPT = [1, 2, 3, 4, 5]  # token ids: the same prompt to both


@pytest.fixture(scope="module")
def llm(base_url: str) -> Iterator[LLM]:
    engine = LLM(Config(model=SERVED["llm"].model_path, num_kvcache_blocks=128,
                        max_model_length=MAX_MODEL_LENGTH, max_num_sequences=32))
    yield engine
    engine.exit()


def served(base_url: str, max_tokens: int) -> tuple[int, Any]:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}
    status, answer = fetch("POST", f"{base_url}/v1/completions", json.dumps(body).encode())
    return status, json.loads(answer)


@pytest.mark.parametrize("max_tokens", [MAX_MODEL_LENGTH - len(PROMPT) + 1, MAX_MODEL_LENGTH,
                                        100_000])
def test_max_tokens_beyond_the_context_is_the_same_refusal(base_url: str, llm: LLM,
                                                           max_tokens: int) -> None:
    status, answer = served(base_url, max_tokens)
    assert status == 400 and answer["error"]["param"] == "max_tokens"
    with pytest.raises(ValueError) as refused:
        llm.generate([PROMPT], SamplingParams(max_tokens=max_tokens), use_tqdm=False)
    assert str(refused.value) == answer["error"]["message"]
    assert (f"max_tokens={max_tokens}: allowed: at most {MAX_MODEL_LENGTH - len(PROMPT)} "
            "beside a prompt") in str(refused.value)


def test_max_tokens_that_fills_the_context_runs_in_both(base_url: str, llm: LLM) -> None:
    fills = MAX_MODEL_LENGTH - len(PROMPT)
    status, answer = served(base_url, fills)
    assert status == 200 and answer["usage"]["completion_tokens"] == fills
    params = SamplingParams(temperature=0.0, max_tokens=fills, ignore_eos=True)
    (out,) = llm.generate([PROMPT], params, use_tqdm=False)
    assert len(out["token_ids"]) == fills
    assert out["text"] == answer["choices"][0]["text"]  # greedy, the same weights


@pytest.mark.parametrize("max_tokens", [0, -3])
def test_max_tokens_below_1_is_the_same_refusal(base_url: str, max_tokens: int) -> None:
    status, answer = served(base_url, max_tokens)
    assert status == 400 and answer["error"]["param"] == "max_tokens"
    with pytest.raises(ValueError) as refused:
        SamplingParams(max_tokens=max_tokens)
    assert str(refused.value) == answer["error"]["message"]
    assert f"max_tokens={max_tokens}: allowed: an int >= 1" in str(refused.value)
    status, chat = fetch("POST", f"{base_url}/v1/chat/completions", json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
         "max_completion_tokens": max_tokens}).encode())
    assert status == 400 and json.loads(chat)["error"]["message"] == str(refused.value)
