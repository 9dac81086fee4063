"""`n` completions per prompt through the server, with the official openai client.

test_server.py's server (conftest.py): the tiny random Qwen3 with a byte-level tokenizer.
The oracles: greedy choices equal the n=1 answer; choices are numbered prompt index * n + i;
usage counts each prompt once and every choice's tokens; a stream's chunks, gathered by
their choice index, give the non-streamed choices; the KV cache is empty afterwards.
"""

from __future__ import annotations

from typing import Any

import pytest

openai = pytest.importorskip("openai")

from test_server import MODEL, metrics, stream_until, wait_for  # noqa: E402

MESSAGES = [{"role": "user", "content": "Name a color."}]
# The tiny model mostly repeats its last token; this hot, its samples differ.
HOT = 5.0


@pytest.fixture(scope="module")
def client(base_url: str) -> Any:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


def greedy(**kwargs: Any) -> dict[str, Any]:
    return dict(model=MODEL, max_tokens=8, temperature=0, extra_body={"ignore_eos": True},
                **kwargs)


def test_greedy_choices_equal_n1_and_usage_counts_the_prompt_once(client: Any) -> None:
    one = client.completions.create(**greedy(prompt="The sky is"))
    three = client.completions.create(**greedy(prompt="The sky is", n=3))
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert [c.text for c in three.choices] == [one.choices[0].text] * 3
    assert {c.finish_reason for c in three.choices} == {"length"}
    assert three.usage.prompt_tokens == one.usage.prompt_tokens == len(b"The sky is")
    assert three.usage.completion_tokens == 3 * one.usage.completion_tokens == 24


def test_a_prompt_batch_with_n_numbers_choices_prompt_index_times_n_plus_i(
        client: Any) -> None:
    prompts = ["Red is", "Blue and green"]
    singles = [client.completions.create(**greedy(prompt=p)).choices[0].text for p in prompts]
    answer = client.completions.create(**greedy(prompt=prompts, n=2))
    assert [c.index for c in answer.choices] == [0, 1, 2, 3]
    assert [c.text for c in answer.choices] == [singles[0]] * 2 + [singles[1]] * 2
    assert answer.usage.prompt_tokens == sum(map(len, map(str.encode, prompts)))
    assert answer.usage.completion_tokens == 4 * 8


def test_streamed_choices_carry_their_index_and_add_up(client: Any) -> None:
    kwargs = dict(model=MODEL, prompt=["Once upon", "a time"], n=2, max_tokens=10,
                  temperature=1.0, seed=5, extra_body={"ignore_eos": True})
    full = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True,
                                            stream_options={"include_usage": True}))
    texts: dict[int, str] = {}
    reasons: dict[int, str | None] = {}
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        texts[choice.index] = texts.get(choice.index, "") + choice.text
        reasons[choice.index] = choice.finish_reason
    assert sorted(texts) == [0, 1, 2, 3]
    assert [texts[i] for i in range(4)] == [c.text for c in full.choices]
    assert [reasons[i] for i in range(4)] == ["length"] * 4
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage
    assert full.usage.completion_tokens == 40


def test_seeded_choices_are_reproducible_and_differ(client: Any) -> None:
    kwargs = dict(model=MODEL, prompt="Colors:", n=3, max_tokens=12, temperature=HOT, seed=9,
                  extra_body={"ignore_eos": True})
    first = [c.text for c in client.completions.create(**kwargs).choices]
    again = [c.text for c in client.completions.create(**kwargs).choices]
    assert first == again
    assert len(set(first)) > 1, "each choice samples on its own"
    # Choice 0 is what n=1 gives with the same seed.
    single = client.completions.create(**dict(kwargs, n=1)).choices[0].text
    assert single == first[0]


def test_chat_with_n_streamed_and_not(client: Any) -> None:
    kwargs = dict(model=MODEL, messages=MESSAGES, n=2, max_tokens=8, temperature=HOT, seed=3,
                  extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kwargs)
    assert [c.index for c in full.choices] == [0, 1]
    assert all(c.message.role == "assistant" for c in full.choices)
    assert full.usage.completion_tokens == 16
    one = client.chat.completions.create(**dict(kwargs, n=1))
    assert full.usage.prompt_tokens == one.usage.prompt_tokens
    chunks = list(client.chat.completions.create(**kwargs, stream=True,
                                                 stream_options={"include_usage": True}))
    texts = {0: "", 1: ""}
    roles = set()
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        texts[choice.index] += choice.delta.content or ""
        if choice.delta.role:
            roles.add(choice.index)
    assert roles == {0, 1}, "each choice's stream opens with the assistant's role"
    assert [texts[0], texts[1]] == [c.message.content for c in full.choices]
    assert chunks[-1].usage == full.usage


def test_a_stop_string_ends_one_choice_and_the_others_go_on(base_url: str,
                                                             client: Any) -> None:
    kwargs = dict(model=MODEL, prompt="Letters:", n=3, max_tokens=32, temperature=HOT,
                  seed=21, extra_body={"ignore_eos": True})
    free = [c.text for c in client.completions.create(**kwargs).choices]
    # A stop string of two printable characters that choice 0 writes and choice 1 never does.
    stop = next(free[0][i:i + 2] for i in range(1, len(free[0]) - 1)
                if free[0][i:i + 2] not in free[1] and free[0][i:i + 2].isascii()
                and free[0][i:i + 2].isprintable())
    answer = client.completions.create(**kwargs, stop=[stop])
    assert answer.choices[0].text == free[0][:free[0].index(stop)]
    assert answer.choices[0].finish_reason == "stop"
    assert answer.choices[1].text == free[1] and answer.choices[1].finish_reason == "length"
    wait_for(lambda: metrics(base_url)["myvllm:kv_cache_usage_perc"] == 0.0,
             "every choice's blocks to be freed")


def test_a_client_leaving_an_n_stream_frees_every_choice(base_url: str) -> None:
    body = {"model": MODEL, "prompt": "A long story:", "max_tokens": 200, "n": 3,
            "ignore_eos": True, "stream": True}
    connection = stream_until(base_url, body, 6)
    assert metrics(base_url)["myvllm:num_requests_running"] == 3
    connection.close()
    wait_for(lambda: metrics(base_url)["myvllm:num_requests_running"] == 0,
             "the choices to leave the running queue")
    wait_for(lambda: metrics(base_url)["myvllm:kv_cache_usage_perc"] == 0.0,
             "the choices' blocks to be freed")


def test_echo_and_logprobs_lead_every_choice(client: Any) -> None:
    """lm-eval's loglikelihood request with n = 2: each choice echoes the prompt with its
    logprobs (computed once, by the first completion), the same as n = 1."""
    kwargs = dict(model=MODEL, prompt=[list(b"Paris is in France")], max_tokens=1,
                  logprobs=1, echo=True, temperature=0)
    one = client.completions.create(**kwargs).choices[0]
    two = client.completions.create(**kwargs, n=2).choices
    assert [c.index for c in two] == [0, 1]
    for choice in two:
        assert choice.text == one.text and choice.text.startswith("Paris is in France")
        assert choice.logprobs.tokens == one.logprobs.tokens
        assert choice.logprobs.token_logprobs[0] is None
        assert choice.logprobs.token_logprobs[1:] == pytest.approx(
            one.logprobs.token_logprobs[1:], abs=1e-5)


def test_best_of_is_refused_by_name(client: Any) -> None:
    with pytest.raises(openai.BadRequestError, match="best_of"):
        client.completions.create(model=MODEL, prompt="Hi", n=2, best_of=3, max_tokens=2)
