"""One `myvllm serve` process for a long run, then its end (slow: a server subprocess).

    soak      hundreds of requests (whole answers, streams, streams left in the middle,
              structured outputs: JSON schemas, choices, and specs refused with a 400) against
              one server: after a warm-up, neither the front end's nor the engine core's
              resident memory grows past a bound, every request ends as it should, and
              /metrics counts exactly the requests sent, by how they ended
    SIGTERM   with a prefill of 8,000 tokens in flight (one step of seconds on a 2-core CPU):
              the server exits 0 within a few seconds, and no process of it is left

The SIGTERM test ends the server, so it comes last in this file.
"""

from __future__ import annotations

import http.client
import json
import random
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from test_cli import alive, descendants, engine_children, free_port, health, serve_subprocess
from test_server import MODEL, finished_by_reason, metrics, tiny_chat_checkpoint, wait_for

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not Path("/proc").is_dir(),
                                 reason="reads the process table from /proc")]

MAX_MODEL_LENGTH = 8192
# The byte-level tokenizer: one token per character. Alone, one step of seconds on a 2-core
# CPU (6,000 tokens: 7-10 s measured).
LONG_PROMPT_TOKENS = 8000
# Growth over the requests after the warm-up, measured on a 2-core CPU: front end +0.0 MiB,
# engine core +0.9 MiB (200 after 50); +0.0 and -6.3 (300 after 100: the core's heap gave
# memory back). A leak of 40 KiB per request fails it.
RSS_GROWTH_LIMIT_MIB = 8.0
WARM_UP_REQUESTS = 50
MEASURED_REQUESTS = 200
CONCURRENCY = 16
# The server's shutdown: 2 s for the core to read Shutdown, then SIGTERM and 1 s, then
# SIGKILL; uvicorn's own stop and the interpreter's exit take about a second more here. It
# took 10-12 s before the core was cut short in its step (5 s for Shutdown, 5 after SIGTERM).
SHUTDOWN_LIMIT_S = 8.0
CHILDREN_EXIT_LIMIT_S = 5.0  # tensor-parallel workers see their core gone within a second


# Structured outputs: a few grammars, each compiled once (before the warm-up ends) and then
# served from the cache, so they add no memory over the measured requests.
SCHEMAS = [{"type": "object", "required": ["ok"], "additionalProperties": False,
            "properties": {"ok": {"type": "boolean"}}},
           {"type": "object", "required": ["kind"], "additionalProperties": False,
            "properties": {"kind": {"enum": ["cat", "dog", "fish"]}}}]
CHOICES = [["yes", "no"], [f"option {i}" for i in range(50)]]
REFUSED = [{"guided_regex": "(unclosed"}, {"guided_json": "[" * 1000 + "]" * 1000},
           {"guided_choice": [str(i) for i in range(2000)]}]
KINDS = ["whole", "chat", "stream", "leave", "json", "choice", "refused"]


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for process {pid}")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[subprocess.Popen[str], int]]:
    path = tiny_chat_checkpoint(tmp_path_factory.mktemp("tiny_chat_8k"),
                                max_position_embeddings=MAX_MODEL_LENGTH)
    port = free_port()
    with serve_subprocess([str(path), "--served-model-name", MODEL, "--max-model-length",
                           str(MAX_MODEL_LENGTH), "--num-kvcache-blocks", "640",
                           "--max-num-sequences", "32", "--log-level", "warning"],
                          port) as proc:
        yield proc, port


# ---------------------------------------------------------------------------- soak
def one_request(port: int, rng: random.Random, kind: str) -> str | None:
    """One request of a kind of KINDS; returns how it ended as the server counts it (its
    finish_reason; "abort" for a stream left in the middle; None for a 400, not counted)."""
    max_tokens = rng.randint(1, 12)
    body: dict[str, Any] = {"model": MODEL, "max_tokens": max_tokens, "ignore_eos": True,
                            "temperature": rng.choice([0.0, 0.8]), "seed": rng.randrange(99)}
    prompt = f"Soak request {rng.randrange(10**6)} " * rng.randint(1, 20)
    if kind in ("json", "choice", "refused"):
        spec = ({"guided_json": rng.choice(SCHEMAS)} if kind == "json" else
                {"guided_choice": rng.choice(CHOICES)} if kind == "choice" else
                rng.choice(REFUSED))
        return structured_request(port, {**body, "prompt": prompt}, spec)
    route = "/v1/completions"
    if kind == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
        route = "/v1/chat/completions"
    else:
        body["prompt"] = prompt
    body["stream"] = kind in ("stream", "leave")
    if kind == "leave":
        body["max_tokens"] = 400  # far more than the events read: it can only end by an abort
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        connection.request("POST", route, json.dumps(body), {"content-type": "application/json"})
        response = connection.getresponse()
        assert response.status == 200, response.read()
        if not body["stream"]:
            answer = json.loads(response.read())
            assert answer["usage"]["completion_tokens"] == max_tokens, answer
            return str(answer["choices"][0]["finish_reason"])
        reason = None
        for line in iter(response.readline, b""):
            if not line.startswith(b"data: "):
                continue
            if line.strip() == b"data: [DONE]":
                break
            if kind == "leave":
                return "abort"  # leaves after the first event: the connection is closed
            reason = json.loads(line[len(b"data: "):])["choices"][0]["finish_reason"] or reason
        assert reason == "length", reason
        return reason
    finally:
        connection.close()


def structured_request(port: int, body: dict[str, Any], spec: dict[str, Any]) -> str | None:
    """A whole answer under spec, a JSON schema or a choice (it ends with "stop" once
    complete, or "length"), or a spec of REFUSED, which the server refuses with a 400 before
    the engine sees it."""
    refused = spec in REFUSED
    # No ignore_eos (refused beside a constraint: the grammar ends with eos).
    body = {**{k: v for k, v in body.items() if k != "ignore_eos"}, **spec, "max_tokens": 40}
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions",
                                     json.dumps(body).encode(),
                                     {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            answer = json.loads(response.read())
    except urllib.error.HTTPError as e:
        assert refused and e.code == 400, (e.code, e.read())
        return None
    assert not refused, answer
    choice = answer["choices"][0]
    if choice["finish_reason"] == "stop":  # complete: valid
        if "guided_json" in spec:
            assert isinstance(json.loads(choice["text"]), dict), choice
        else:
            assert choice["text"] in spec["guided_choice"], choice
    return str(choice["finish_reason"])


def run_requests(port: int, num: int, seed: int) -> Counter[str]:
    """num requests of random kinds, CONCURRENCY at a time; how many ended each way (the
    refused ones, which the server does not count, left out)."""
    rng = random.Random(seed)
    kinds = [rng.choice(KINDS) for _ in range(num)]
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        ends = pool.map(lambda i: one_request(port, random.Random(seed * 10**6 + i), kinds[i]),
                        range(num))
        return Counter(end for end in ends if end is not None)


def compile_every_grammar(port: int) -> Counter[str]:
    """One request of each schema and choice list: each grammar is compiled and cached (with
    the compiler itself) before memory is measured."""
    ends: Counter[str] = Counter()
    specs = ([{"guided_json": schema} for schema in SCHEMAS]
             + [{"guided_choice": choices} for choices in CHOICES])
    for spec in specs:
        end = structured_request(port, {"model": MODEL, "prompt": "Warm up",
                                        "temperature": 0.0}, spec)
        assert end is not None
        ends[end] += 1
    return ends


def test_soak_memory_stays_bounded_and_metrics_count_every_request(
        server: tuple[subprocess.Popen[str], int]) -> None:
    proc, port = server
    (core,) = engine_children(proc.pid)
    base_url = f"http://127.0.0.1:{port}"

    def idle() -> bool:
        m = metrics(base_url)
        return (m["myvllm:num_requests_running"] == 0 and m["myvllm:num_requests_waiting"] == 0
                and m["myvllm:kv_cache_usage_perc"] == 0.0)

    ended = compile_every_grammar(port) + run_requests(port, WARM_UP_REQUESTS, seed=1)
    wait_for(idle, "the warm-up's requests to end")
    before = {"front end": rss_mib(proc.pid), "engine core": rss_mib(core)}
    started = time.monotonic()
    ended += run_requests(port, MEASURED_REQUESTS, seed=2)
    took = time.monotonic() - started
    wait_for(idle, "every request to end and free its blocks")
    after = {"front end": rss_mib(proc.pid), "engine core": rss_mib(core)}
    growth = {name: after[name] - before[name] for name in before}
    print(f"{MEASURED_REQUESTS} requests in {took:.1f} s; RSS MiB before {before}, "
          f"after {after}")
    for name, mib in growth.items():
        assert mib < RSS_GROWTH_LIMIT_MIB, f"the {name}'s RSS grew by {mib:.1f} MiB: {growth}"

    # Every request counted once, by how it ended ("length": ignore_eos or max_tokens;
    # "stop": a structured output complete; "abort": left; a 400 is not a request).
    wait_for(lambda: finished_by_reason(base_url) == {r: float(n) for r, n in ended.items()},
             f"/metrics to count {dict(ended)}", timeout_s=10)
    assert health(port) == 200


# ---------------------------------------------------------------------------- SIGTERM
def test_sigterm_during_a_long_prefill_exits_0_within_seconds(
        server: tuple[subprocess.Popen[str], int]) -> None:
    proc, port = server
    left = descendants(proc.pid)
    answer: dict[str, Any] = {}

    def long_prompt() -> None:
        body = json.dumps({"model": MODEL, "prompt": "ab" * (LONG_PROMPT_TOKENS // 2),
                           "max_tokens": 4}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                         {"content-type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=60) as r:
                answer["status"] = r.status
        except urllib.error.HTTPError as e:
            answer["status"], answer["body"] = e.code, e.read()

    waiting = threading.Thread(target=long_prompt)
    waiting.start()
    time.sleep(1.0)  # the prompt is tokenized and sent: the core is in its prefill
    signalled = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    waiting.join(30)
    assert answer.get("status") == 503, answer  # cut by the shutdown: not a 200 with part of it

    output = proc.communicate(timeout=60)[0]
    took = time.monotonic() - signalled
    print(f"exited {proc.returncode} {took:.1f} s after SIGTERM; its log:\n{output[-2000:]}")
    assert proc.returncode == 0, output[-3000:]
    assert took < SHUTDOWN_LIMIT_S, f"the server took {took:.1f} s to exit"
    for bad in ("Traceback", "terminate called", "Aborted"):
        assert bad not in output, output[-3000:]
    # The path under test: the core was still in the prefill's step when Shutdown was sent
    # (alone, one step of many seconds here; a stream decoding beside it would cut the prompt
    # into short chunks, max_prefill_tokens_while_decoding). A machine that prefills the
    # prompt in under 2 s needs a longer one.
    assert "did not stop within 2 s" in output, output[-3000:]
    deadline = time.monotonic() + CHILDREN_EXIT_LIMIT_S
    while any(alive(pid) for pid in left):
        assert time.monotonic() < deadline, f"left behind: {[p for p in left if alive(p)]}"
        time.sleep(0.1)
