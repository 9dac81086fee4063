"""Two data-parallel replicas behind one server (DPAsyncLLM), on the CPU: the answers are one
engine's, the router spreads unrelated prompts and keeps a shared prefix on one replica (which
finds more prefix-cache hits than sending requests in turn), /metrics and /health speak for
both replicas, and aborts reach the right one.

One server for the module: a tiny random Qwen3 with the byte-level test tokenizer, two engine
core processes, uvicorn in a thread (starting two cores takes tens of seconds on a busy
2-core machine, hence slow).
"""

from __future__ import annotations

import asyncio
import http.client
import json
import random
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from myvllm import LLM, Config, SamplingParams
from myvllm.serving.dp_async_llm import DPAsyncLLM
from test_server import (MAX_MODEL_LENGTH, MODEL, fetch, metrics, served_in_thread,
                         tiny_chat_checkpoint, wait_for)

pytestmark = pytest.mark.slow

BLOCK_SIZE = 16
ENGINE_KW: dict[str, Any] = dict(num_kvcache_blocks=128, max_model_length=MAX_MODEL_LENGTH,
                                 max_num_sequences=32, block_size=BLOCK_SIZE)
# Different from their first byte on (a shared opening would keep them on one replica).
PROMPTS = [f"{i} is the number this short note is about" for i in range(8)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_chat_checkpoint(tmp_path_factory.mktemp("tiny_dp"))


@pytest.fixture(scope="module")
def served(checkpoint: Path) -> Iterator[tuple[str, DPAsyncLLM]]:
    llm = DPAsyncLLM(Config(model=str(checkpoint), data_parallel_size=2, **ENGINE_KW))
    with served_in_thread(llm, MODEL, log_level="warning") as url:
        yield url, llm


def complete(base_url: str, **body: Any) -> dict[str, Any]:
    status, answer = fetch("POST", f"{base_url}/v1/completions",
                           json.dumps({"model": MODEL, **body}).encode())
    assert status == 200, answer
    result: dict[str, Any] = json.loads(answer)
    return result


def test_each_replica_is_a_process_of_its_own(served: tuple[str, DPAsyncLLM]) -> None:
    base_url, llm = served
    pids = llm.core_pids
    assert len(pids) == 2 and len(set(pids)) == 2 and all(pid is not None for pid in pids)
    assert fetch("GET", f"{base_url}/health")[0] == 200
    assert llm.config.data_parallel_size == 2
    assert all(r.config.data_parallel_size == 1 for r in llm.replicas)


def test_generate_refuses_a_bad_call_in_the_form(served: tuple[str, DPAsyncLLM]) -> None:
    """DPAsyncLLM.generate refuses before it routes: what was given, then what is allowed."""
    _, llm = served

    async def first_output() -> None:
        async for _ in llm.generate("hi", "greedy"):  # type: ignore[arg-type]
            break

    with pytest.raises(TypeError, match="sampling_params='greedy': allowed: a SamplingParams"):
        asyncio.run_coroutine_threadsafe(first_output(), llm.replicas[0]._loop).result(120)


def test_two_replicas_give_one_engines_greedy_answers(served: tuple[str, DPAsyncLLM],
                                                      checkpoint: Path) -> None:
    """A batch of prompts, each its own request spread over both replicas, and a request of
    n=2 (forked on its one replica), all at once: each answer is the one-engine answer."""
    base_url, llm = served
    routed_before = list(llm.router.num_routed)
    greedy = dict(max_tokens=8, temperature=0, ignore_eos=True)
    answers: dict[str, Any] = {}

    def batch() -> None:
        answers["batch"] = complete(base_url, prompt=PROMPTS, **greedy)

    def forked() -> None:
        answers["n"] = complete(base_url, prompt="7 forks of one prompt", n=2, **greedy)

    threads = [threading.Thread(target=batch), threading.Thread(target=forked)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    routed = [now - before for now, before in zip(llm.router.num_routed, routed_before)]
    assert sum(routed) == len(PROMPTS) + 1
    assert min(routed) >= 3, f"unrelated prompts were not spread: {routed}"

    reference = LLM(Config(model=str(checkpoint), **ENGINE_KW))
    try:
        expected = [o["text"] for o in reference.generate(
            [*PROMPTS, "7 forks of one prompt"],
            SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)]
    finally:
        reference.exit()
    batch_texts = [c["text"] for c in sorted(answers["batch"]["choices"],
                                             key=lambda c: c["index"])]
    assert batch_texts == expected[:-1]
    assert [c["text"] for c in answers["n"]["choices"]] == [expected[-1]] * 2


def prefix_hits(base_url: str, prompts: list[str]) -> float:
    """Prefix-cache hit tokens (summed over the replicas, from /metrics) of prompts sent one
    after another."""
    before = metrics(base_url)["myvllm:prefix_cache_hits_total"]
    for prompt in prompts:
        complete(base_url, prompt=prompt, max_tokens=2, temperature=0, ignore_eos=True)
    return metrics(base_url)["myvllm:prefix_cache_hits_total"] - before


def shared_prefix_workload(seed: int) -> tuple[list[str], int]:
    """Four prefixes of three blocks, two requests each, back to back: what a few system
    prompts (or conversations) look like to the router."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    prompts = []
    for _ in range(4):
        prefix = "".join(rng.choice(letters) for _ in range(3 * BLOCK_SIZE))
        prompts += [f"{prefix} question {rng.randrange(10**6)}" for _ in range(2)]
    return prompts, 3 * BLOCK_SIZE


def test_prefix_routing_finds_more_cache_hits_than_round_robin(
        served: tuple[str, DPAsyncLLM]) -> None:
    base_url, llm = served
    prompts, prefix_len = shared_prefix_workload(seed=1)
    with_prefix = prefix_hits(base_url, prompts)
    # Each second request found its prefix: on the replica that computed it.
    assert with_prefix >= 4 * prefix_len
    llm.router.policy = "round_robin"
    try:
        prompts, _ = shared_prefix_workload(seed=2)  # new prefixes: no cache holds them
        in_turn = prefix_hits(base_url, prompts)
    finally:
        llm.router.policy = "prefix"
    # In turn, the two requests of a prefix land on different replicas: no hit.
    assert in_turn == 0
    assert with_prefix > in_turn


def open_stream(base_url: str, prompt: str) -> tuple[http.client.HTTPConnection, Any]:
    """A long greedy stream, once its first event has come."""
    host, port = base_url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 200, "temperature": 0,
            "ignore_eos": True, "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(body),
                 {"content-type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    assert response.readline().startswith(b"data: {")
    return conn, response


def test_metrics_sum_the_replicas_and_aborts_reach_the_right_one(
        served: tuple[str, DPAsyncLLM]) -> None:
    """One stream on each replica: the queues of /metrics are both replicas' together; a
    client that leaves aborts its request on its replica, and the other streams on."""
    base_url, llm = served
    wait_for(lambda: llm.router.load == [0, 0], "nothing in flight")
    # Shorter than a block: no prefix to follow, so the least loaded, replica 0 then 1.
    first = open_stream(base_url, "stream A")
    second = open_stream(base_url, "stream B")
    try:
        assert llm.router.load == [1, 1]
        assert sorted(llm._replica_of.values()) == [0, 1]
        wait_for(lambda: metrics(base_url)["myvllm:num_requests_running"] == 2,
                 "each replica's running request counted")
        assert metrics(base_url)["myvllm:kv_cache_usage_perc"] > 0
        first[0].close()  # the client of replica 0's request leaves
        wait_for(lambda: llm.router.load == [0, 1], "the request left replica 0")
        wait_for(lambda: not llm.replicas[0]._by_request_id, "replica 0 aborted it")
        assert len(llm.replicas[1]._by_request_id) == 1
        wait_for(lambda: metrics(base_url)["myvllm:num_requests_running"] == 1,
                 "replica 0's core freed it")
        assert second[1].readline()  # still streaming
    finally:
        first[0].close()
        second[0].close()
    wait_for(lambda: metrics(base_url)["myvllm:num_requests_running"] == 0, "all aborted")
    wait_for(lambda: metrics(base_url)["myvllm:kv_cache_usage_perc"] == 0.0,
             "every block back")
    assert fetch("GET", f"{base_url}/health")[0] == 200
