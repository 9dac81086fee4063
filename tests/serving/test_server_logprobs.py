"""logprobs and echo through the server, with the official openai client, against the HF
model's log-softmax.

test_server.py's server (conftest.py): the tiny random Qwen3 with a byte-level tokenizer
(token i = byte i), so an ASCII text's tokens are its bytes and their texts add up to it. A
byte of 128 or more is part of a UTF-8 character: decoded alone (as vLLM names tokens) it is
"\ufffd", so the checks below look tokens up by id where the random model writes those.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

openai = pytest.importorskip("openai")

import torch  # noqa: E402
from helpers_models import hf_greedy, load_hf_reference  # noqa: E402
from test_server import MODEL, SERVED, fetch  # noqa: E402

ATOL = 1e-4


@pytest.fixture(scope="module")
def client(base_url: str) -> Any:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def hf(base_url: str) -> Any:
    return load_hf_reference(SERVED["llm"].model_path)


def reference(hf: Any, token_ids: list[int]) -> torch.Tensor:
    """[len, V]: row i is the log-softmax of the logits after token i."""
    with torch.inference_mode():
        return torch.log_softmax(hf(torch.tensor([token_ids])).logits[0].float(), dim=-1)


def test_lm_evals_loglikelihood_request(client: Any, hf: Any) -> None:
    """lm-evaluation-harness's local-completions request for a multiple-choice task: token-id
    prompts, one greedy token, logprobs 1, echo. Its reading: the sum of token_logprobs over
    the continuation, and whether each continuation token is the top one."""
    contexts = [list(b"The answer is"), list(b"Paris is in")]
    continuations = [list(b" yes"), list(b" France")]
    prompts = [c + k for c, k in zip(contexts, continuations)]
    answer = client.completions.create(model=MODEL, prompt=prompts, max_tokens=1, logprobs=1,
                                       echo=True, temperature=0, seed=1234)
    for choice, prompt, context in zip(answer.choices, prompts, contexts):
        lp = choice.logprobs
        assert len(lp.token_logprobs) == len(prompt) + 1  # the prompt's, then the new token's
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        ref = reference(hf, prompt)
        generated = int(ref[-1].argmax())  # temperature 0
        ref = reference(hf, prompt + [generated])
        for i in range(1, len(prompt)):
            assert lp.token_logprobs[i] == pytest.approx(ref[i - 1, prompt[i]].item(), abs=ATOL)
        assert lp.token_logprobs[-1] == pytest.approx(ref[-2, generated].item(), abs=ATOL)
        assert lp.tokens[:-1] == [chr(t) for t in prompt]
        assert choice.text.startswith(bytes(prompt).decode())
        assert lp.text_offset == list(range(len(prompt) + 1))
        # lm-eval's reading of the answer (its openai_completions parse_logprobs).
        ctxlen = len(context)
        continuation = lp.token_logprobs[ctxlen:-1]
        assert sum(continuation) == pytest.approx(
            sum(ref[i - 1, prompt[i]].item() for i in range(ctxlen, len(prompt))), abs=1e-3)
        greedy = all(t == max(top.values())
                     for t, top in zip(continuation, lp.top_logprobs[ctxlen:-1]))
        expected = all(prompt[i] == ref[i - 1].argmax().item()
                       for i in range(ctxlen, len(prompt)))
        assert greedy == expected
        for i in range(1, len(prompt) + 1):  # the top-1 and the token itself
            top = lp.top_logprobs[i]
            best = int(ref[i - 1].argmax())
            if best < 128:  # named by itself, not "\ufffd"
                assert top[chr(best)] == pytest.approx(ref[i - 1, best].item(), abs=ATOL)
            assert lp.tokens[i] in top and len(top) in (1, 2)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_completion_logprobs_without_echo(client: Any, hf: Any, stream: bool) -> None:
    prompt = "Logprobs, please"
    kw: dict[str, Any] = dict(model=MODEL, prompt=prompt, max_tokens=5, logprobs=3,
                              temperature=0, extra_body={"ignore_eos": True})
    if stream:
        tokens: list[str] = []
        token_logprobs: list[float] = []
        tops: list[dict[str, float]] = []
        offsets: list[int] = []
        text = ""
        for event in client.completions.create(stream=True, **kw):
            for choice in event.choices:
                text += choice.text
                if choice.logprobs is not None:
                    tokens += choice.logprobs.tokens
                    token_logprobs += choice.logprobs.token_logprobs
                    tops += choice.logprobs.top_logprobs
                    offsets += choice.logprobs.text_offset
    else:
        choice = client.completions.create(**kw).choices[0]
        text = choice.text
        tokens, token_logprobs = choice.logprobs.tokens, choice.logprobs.token_logprobs
        tops, offsets = choice.logprobs.top_logprobs, choice.logprobs.text_offset
    ids = list(prompt.encode())
    completion = hf_greedy(hf, ids, 5)
    assert len(tokens) == 5 and offsets == [sum(map(len, tokens[:i])) for i in range(5)]
    assert [ord(t) for t in tokens if t != "\ufffd"] == [t for t in completion if t < 128]
    ref = reference(hf, ids + completion)
    for i, token in enumerate(completion):
        row = ref[len(ids) - 1 + i]
        assert token_logprobs[i] == pytest.approx(row[token].item(), abs=ATOL)
        best = row.topk(3)
        for logprob, best_id in zip(best.values.tolist(), best.indices.tolist()):
            if best_id < 128:  # named by itself, not "\ufffd"
                assert tops[i][chr(best_id)] == pytest.approx(logprob, abs=ATOL)
        assert len(tops[i]) <= 4


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_logprobs(client: Any, base_url: str, hf: Any, stream: bool) -> None:
    messages = [{"role": "user", "content": "Hi there"}]
    kw: dict[str, Any] = dict(model=MODEL, messages=messages, max_tokens=4, logprobs=True,
                              top_logprobs=2, temperature=0, extra_body={"ignore_eos": True})
    if stream:
        content = []
        for event in client.chat.completions.create(stream=True, **kw):
            for choice in event.choices:
                if choice.logprobs is not None:
                    content += choice.logprobs.content
    else:
        answer = client.chat.completions.create(**kw)
        content = answer.choices[0].logprobs.content
    status, body = fetch("POST", f"{base_url}/tokenize",
                         json.dumps({"messages": messages}).encode())
    assert status == 200
    prompt = json.loads(body)["tokens"]
    completion = hf_greedy(hf, prompt, 4)
    assert len(content) == 4
    ref = reference(hf, prompt + completion)
    for i, entry in enumerate(content):
        row = ref[len(prompt) - 1 + i]
        assert entry.logprob == pytest.approx(row[completion[i]].item(), abs=ATOL)
        assert entry.bytes == list(entry.token.encode())
        best = row.topk(2)
        assert [top.logprob for top in entry.top_logprobs] == pytest.approx(
            best.values.tolist(), abs=ATOL)
        assert [top.token for top in entry.top_logprobs] == [
            chr(t) if t < 128 else "\ufffd" for t in best.indices.tolist()]


def test_echo_without_logprobs_prepends_the_prompt(client: Any) -> None:
    plain = client.completions.create(model=MODEL, prompt="Echo me", max_tokens=3,
                                      temperature=0)
    echoed = client.completions.create(model=MODEL, prompt="Echo me", max_tokens=3,
                                       temperature=0, echo=True)
    assert echoed.choices[0].text == "Echo me" + plain.choices[0].text
    assert echoed.choices[0].logprobs is None
    events = client.completions.create(model=MODEL, prompt=list(b"Echo me"), max_tokens=3,
                                       temperature=0, echo=True, stream=True)
    assert "".join(c.text for e in events for c in e.choices) == echoed.choices[0].text


@pytest.mark.parametrize("path, field, message", [
    ("/v1/completions", {"logprobs": 21}, "logprobs: Input should be less than or equal to 20"),
    ("/v1/completions", {"logprobs": -1}, "logprobs: Input should be greater than or equal"),
    ("/v1/completions", {"logprobs": 1.5}, "logprobs: Input should be a valid integer"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs=2: allowed: only with logprobs: true"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21},
     "top_logprobs: Input should be less than or equal to 20"),
])
def test_bad_logprobs_are_400s(base_url: str, path: str, field: dict[str, Any],
                               message: str) -> None:
    base: dict[str, Any] = ({"messages": [{"role": "user", "content": "Hi"}]}
                            if "chat" in path else {"prompt": "Hi"})
    status, body = fetch("POST", f"{base_url}{path}",
                         json.dumps({**base, **field, "max_tokens": 2}).encode())
    assert status == 400 and message in json.loads(body)["error"]["message"], body
