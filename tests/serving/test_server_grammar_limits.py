"""Structured outputs that once took the server down or froze it, against a served engine.

The tiny chat model behind the real HTTP server, its engine core in a process of its own, with
tight grammar limits so that each attack is quick: grammar_compile_timeout_s=0.4 and a step's
grammar work bounded by 2 ms (grammar_step_budget_ms=2, grammar_step_budget_multiple=0). Each test sends its attack (in a thread when it takes a while) and,
meanwhile and afterwards, asks /health and a small completion, each of which must answer
within RESPONSIVE_S; the attack gets its 400 naming the limit and its own figure, or ends
with finish_reason "grammar_too_slow".
"""

from __future__ import annotations

import json
import random
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_server import MAX_MODEL_LENGTH, MODEL, served_in_thread, tiny_chat_checkpoint

from myvllm import Config
from myvllm.serving.async_llm import AsyncLLM

RESPONSIVE_S = 10.0  # /health and a small request, while an attack runs (the client's timeout)
# A grammar within every static limit (1,000 rules, under 100,000 characters) that compiles in
# about 2 s on a 2-core CPU (0.7 s for rules of 20 characters): past the server's 0.4 s.
SLOW_GRAMMAR = "root ::= r0\n" + "\n".join(
    f'r{i} ::= "{"abcdefghij" * 7}{i}" r{(i + 1) % 999}?' for i in range(999))
AMBIGUOUS_GRAMMAR = 'root ::= s\ns ::= s s | "a" | "b" | ""'


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, AsyncLLM]]:
    path = tiny_chat_checkpoint(tmp_path_factory.mktemp("tiny_chat_grammars"))
    llm = AsyncLLM(Config(model=str(path), num_kvcache_blocks=128,
                          max_model_length=MAX_MODEL_LENGTH, max_num_sequences=32,
                          grammar_compile_timeout_s=0.4, grammar_step_budget_ms=2.0,
                          grammar_step_budget_multiple=0.0))
    with served_in_thread(llm, MODEL, log_level="warning") as url:
        yield url, llm


def post(url: str, body: dict[str, Any], timeout_s: float = 120.0) -> tuple[int, Any]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def completion(url: str, timeout_s: float = 120.0, **fields: Any) -> tuple[int, Any]:
    return post(f"{url}/v1/completions", {"model": MODEL, "prompt": "Name a pet:",
                                          "max_tokens": 8, "temperature": 0.0, **fields},
                timeout_s)


def assert_responsive(url: str) -> None:
    """/health and a small completion each answer within RESPONSIVE_S."""
    with urllib.request.urlopen(f"{url}/health", timeout=RESPONSIVE_S) as response:
        assert response.status == 200
    status, answer = completion(url, timeout_s=RESPONSIVE_S, max_tokens=4)
    assert status == 200, answer


def while_responsive(url: str, attack: Any) -> Any:
    """Run attack() in a thread; the server answers meanwhile (at least once, and until it
    ends) and afterwards. Returns what attack returned."""
    result: list[Any] = []
    thread = threading.Thread(target=lambda: result.append(attack()), daemon=True)
    thread.start()
    assert_responsive(url)
    while thread.is_alive():
        assert_responsive(url)
        thread.join(0.5)
    assert_responsive(url)
    assert result, "the attack raised (see the thread's traceback above)"
    return result[0]


def refusal(status: int, answer: Any) -> str:
    assert status == 400, (status, answer)
    return str(answer["error"]["message"])


def test_a_huge_grammar_is_refused_before_any_compile(served: tuple[str, AsyncLLM]) -> None:
    url, _ = served
    rng = random.Random(0)
    grammar = "root ::= " + " | ".join(f"r{i}" for i in range(15_000)) + "\n" + "\n".join(
        f'r{i} ::= "{"".join(rng.choice("abcdefgh") for _ in range(20))}"'
        for i in range(15_000))
    assert 500_000 < len(grammar) < 1 << 20  # under the body limit (the attack)
    message = refusal(*while_responsive(url, lambda: completion(url, guided_grammar=grammar)))
    assert "StructuredOutputsParams.grammar has 15,001 rules" in message
    assert "allowed: at most 1,000 (MAX_GRAMMAR_RULES)" in message
    message = refusal(*completion(url, guided_regex="a" * 150_000))
    assert ("regex has 150,000 characters; allowed: at most 100,000 (MAX_GRAMMAR_CHARS)"
            in message)


def test_a_deeply_nested_schema_is_a_400_not_a_500(served: tuple[str, AsyncLLM]) -> None:
    url, _ = served
    deep_text = "[" * 1000 + "]" * 1000
    for fields in ({"guided_json": deep_text},
                   {"structured_outputs": {"json": deep_text}},
                   {"response_format": {"type": "json_schema", "json_schema": {
                       "name": "deep", "schema": {"$defs": json.loads("[" * 100 + "]" * 100)}
                   }}}):
        path = "chat/completions" if "response_format" in fields else "completions"
        body = ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                 "max_tokens": 4} if path.startswith("chat") else
                {"model": MODEL, "prompt": "hi", "max_tokens": 4})
        message = refusal(*post(f"{url}/v1/{path}", {**body, **fields}))
        assert "deep (objects and arrays); allowed: at most 64 (MAX_SCHEMA_DEPTH)" in message
    assert_responsive(url)


def test_a_grammar_past_the_compile_limit_is_a_400(served: tuple[str, AsyncLLM]) -> None:
    url, _ = served
    message = refusal(*while_responsive(url, lambda: completion(
        url, guided_grammar=SLOW_GRAMMAR)))
    assert "did not compile within grammar_compile_timeout_s=0.4 s (abandoned after" in message
    # Asked for again: refused at once, from memory.
    message = refusal(*completion(url, guided_grammar=SLOW_GRAMMAR))
    assert "when it was asked for before; allowed: one that compiles within 0.4 s" in message


def test_an_ambiguous_grammar_ends_as_grammar_too_slow(served: tuple[str, AsyncLLM]) -> None:
    """Each token costs its matcher more (Earley over an ambiguous grammar); with eos
    banned by min_tokens it would grow for good. Past 2 ms of a step the request ends."""
    url, _ = served
    status, answer = while_responsive(url, lambda: completion(
        url, prompt="a", guided_grammar=AMBIGUOUS_GRAMMAR, max_tokens=240, min_tokens=240))
    assert status == 200, answer
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "grammar_too_slow", choice
    assert set(choice["text"]) <= {"a", "b"} and 0 < answer["usage"]["completion_tokens"] < 240


def test_broken_schemas_and_grammars_are_400s(served: tuple[str, AsyncLLM]) -> None:
    url, _ = served
    for fields, says in [
            ({"guided_json": {"type": "nonsense"}}, 'Unsupported type "nonsense"'),
            ({"guided_json": "{not json"}, "json is not valid JSON"),
            ({"guided_regex": "(unclosed"}, "regex cannot be compiled"),
            ({"guided_grammar": 'item ::= "a"'}, 'root rule with name "root"'),
            ({"guided_grammar": "root ::= " + "(" * 2000 + '"a"' + ")" * 2000},
             "grammar cannot be compiled"),
            ({"guided_choice": []}, "choice=[]: allowed: a non-empty list")]:
        message = refusal(*completion(url, **fields))
        assert says in message, (fields, message)
    assert_responsive(url)


def core_rss_mb(llm: AsyncLLM) -> float:
    status = Path(f"/proc/{llm.core_pid}/status").read_text()
    return int(next(line for line in status.splitlines()
                    if line.startswith("VmRSS:")).split()[1]) / 1024


def test_many_choices_are_bounded_in_count_and_memory(served: tuple[str, AsyncLLM]) -> None:
    url, llm = served
    message = refusal(*completion(url, guided_choice=[f"pet {i}" for i in range(40_000)]))
    assert "choice has 40,000 strings; allowed: at most 1,024 (MAX_CHOICES)" in message
    completion(url, guided_choice=["warm", "up"])  # the compiler is made: not counted below
    before = core_rss_mb(llm)
    for list_number in range(5):  # five lists at the limit, each its own grammar
        choices = [f"pet {list_number} {i}" for i in range(1024)]
        status, answer = completion(url, guided_choice=choices)
        assert status == 200 and answer["choices"][0]["text"] in choices, answer
    grown = core_rss_mb(llm) - before
    # Five 40,000-entry lists used to keep 1.3-2.6 GB in the core.
    assert grown < 200, f"the core grew by {grown:.0f} MB"


def test_a_repeated_schema_is_served_to_every_request(served: tuple[str, AsyncLLM]) -> None:
    """Sixteen requests of one schema at once: one compile that they all wait for
    (test_engine_core_grammars.py counts the compiles), every answer valid."""
    url, _ = served
    schema = {"type": "object", "required": ["ok"], "additionalProperties": False,
              "properties": {"ok": {"type": "boolean"}}}
    results: list[tuple[int, Any]] = []

    def one(seed: int) -> None:
        results.append(completion(url, guided_json=schema, max_tokens=40, temperature=1.0,
                                  seed=seed))

    threads = [threading.Thread(target=one, args=(seed,)) for seed in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert len(results) == 16
    for status, answer in results:
        assert status == 200, answer
        choice = answer["choices"][0]
        if choice["finish_reason"] == "stop":
            assert json.loads(choice["text"])["ok"] in (True, False)
    assert_responsive(url)
