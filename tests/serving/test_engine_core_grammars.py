"""Structured outputs in the engine core's busy loop: grammars compile in threads, off the loop.

The loop runs in a thread over its real sockets (test_engine_core_process.py's Front plays
the front end). A compile is held on an Event where the test needs it slow, so "while it
compiles" needs no clock: a request waiting for its grammar is held outside the scheduler,
the other requests step meanwhile, and one past Config.grammar_compile_timeout_s is refused.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from test_engine_core_process import Front, core, front, run_loop, stop  # noqa: F401

from myvllm import SamplingParams
from myvllm.engine.core import EngineCore
from myvllm.sampling_parameters import StructuredOutputsParams
from myvllm.serving.core_messages import AbortRequests, AddRequest, CoreOutputs
from myvllm.structured_output.grammar_cache import GrammarCache
from myvllm.structured_output.manager import StructuredOutputManager, manager_for

PLAIN = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def constrained(regex: str = "[ab]{3,5}") -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=20,
                          structured_outputs=StructuredOutputsParams(regex=regex))


@pytest.fixture
def held_compiles(core: EngineCore, monkeypatch: pytest.MonkeyPatch
                  ) -> Iterator[threading.Event]:
    """A fresh grammar manager whose compiles wait until the Event is set (set at the end
    of the test, so that no compile thread is left waiting)."""
    may_compile = threading.Event()
    compile_now = StructuredOutputManager._compile

    def held(self: StructuredOutputManager, params: StructuredOutputsParams) -> Any:
        assert may_compile.wait(60), "the test never let the compile run"
        return compile_now(self, params)

    monkeypatch.setattr(StructuredOutputManager, "_compile", held)
    monkeypatch.setattr(core, "structured_outputs", None)
    yield may_compile
    may_compile.set()


def messages_until(front: Front, done: Any) -> list[CoreOutputs]:
    """Messages until done(all so far) is true."""
    seen: list[CoreOutputs] = []
    while not done(seen):
        message = front.receive()
        assert isinstance(message, CoreOutputs), message
        seen.append(message)
    return seen


def finished(seen: list[CoreOutputs], request_id: int) -> bool:
    return any(out.request_id == request_id and out.finish_reason is not None
               for message in seen for out in message.outputs)


def text_of(seen: list[CoreOutputs], request_id: int) -> str:
    ids = [t for m in seen for out in m.outputs if out.request_id == request_id
           for t in out.new_token_ids]
    return bytes(t for t in ids if t != 0).decode()  # the byte tokenizer, eos = 0


def test_a_request_waits_for_its_grammar_outside_the_scheduler_while_others_step(
        core: EngineCore, front: Front, held_compiles: threading.Event,
        monkeypatch: pytest.MonkeyPatch) -> None:
    queued: list[Any] = []
    add_sequence = core.scheduler.add_sequence

    def spy(seq: Any) -> None:  # what the scheduler is given: never a grammar not ready
        queued.append(seq)
        if seq.sampling_params.structured_outputs is not None:
            assert seq.extras.grammar_matcher is not None
        add_sequence(seq)

    monkeypatch.setattr(core.scheduler, "add_sequence", spy)
    _, thread = run_loop(core, front)
    front.send(AddRequest(1, [5, 6, 7], constrained(), True))
    front.send(AddRequest(2, [5, 6, 8], PLAIN, True))
    # The plain request runs to its end while the grammar's compile is held.
    seen = messages_until(front, lambda seen: finished(seen, 2))
    assert not finished(seen, 1)
    assert [seq.sampling_params for seq in queued] == [PLAIN]
    assert seen[-1].stats.num_waiting == 1  # the one waiting for its grammar counts
    held_compiles.set()
    seen = messages_until(front, lambda seen: finished(seen, 1))
    stop(front, thread)
    assert re.fullmatch("[ab]{3,5}", text_of(seen, 1))


def test_a_grammar_past_its_time_limit_is_refused_and_remembered(
        core: EngineCore, front: Front, held_compiles: threading.Event) -> None:
    core.structured_outputs = StructuredOutputManager(
        core.model_path, core.vocab_size, [0], compile_timeout_s=0.2)
    _, thread = run_loop(core, front)
    front.send(AddRequest(1, [5, 6, 7], constrained(), True))
    front.send(AddRequest(2, [5, 6, 8], PLAIN, True))
    seen = messages_until(front, lambda seen: any(m.refused for m in seen)
                          and finished(seen, 2))
    [refusal] = [r for m in seen for r in m.refused]
    assert refusal.request_id == 1 and refusal.error_type == "ValueError"
    assert re.search(r"StructuredOutputsParams.regex did not compile within "
                     r"grammar_compile_timeout_s=0.2 s \(abandoned after 0\.\d s\); "
                     r"allowed: one that compiles within 0.2 s", refusal.message), refusal
    # The same grammar again: refused at once, no thread taken.
    front.send(AddRequest(3, [5, 6, 7], constrained(), True))
    seen = messages_until(front, lambda seen: any(m.refused for m in seen))
    [again] = [r for m in seen for r in m.refused]
    assert again.request_id == 3 and "when it was asked for before" in again.message
    assert manager_for(core).num_compiles == 1
    stop(front, thread)
    assert not core.requests


def test_the_wait_for_a_compile_thread_counts_against_the_time_limit(
        core: EngineCore, front: Front, held_compiles: threading.Event) -> None:
    """Both compile threads held by two grammars: a third waits in the queue, and its request
    is refused at its time limit all the same, its compile withdrawn before it ever ran;
    the plain request beside them ends as usual."""
    manager = core.structured_outputs = StructuredOutputManager(
        core.model_path, core.vocab_size, [0], compile_timeout_s=0.3)
    _, thread = run_loop(core, front)
    for request_id, regex in [(1, "a{2}b"), (2, "b{2}a"), (3, "[ab]{3,5}")]:
        front.send(AddRequest(request_id, [5, 6, 7], constrained(regex), True))
    front.send(AddRequest(4, [5, 6, 8], PLAIN, True))
    seen = messages_until(front, lambda seen: len([r for m in seen for r in m.refused]) == 3
                          and finished(seen, 4))
    refusals = {r.request_id: r.message for m in seen for r in m.refused}
    assert re.search(r"StructuredOutputsParams.regex was not ready within "
                     r"grammar_compile_timeout_s=0.3 s of its request \(0\.\d s waiting for a "
                     r"compile thread, 0\.0 s compiling\); allowed: one that compiles within "
                     r"0.3 s, the wait for a compile thread included", refusals[3]), refusals[3]
    assert len(manager.compile_threads) == 0  # withdrawn: it will never run
    plain = [out for m in seen for out in m.outputs if out.request_id == 4]
    assert sum(len(out.new_token_ids) for out in plain) == PLAIN.max_tokens
    assert plain[-1].finish_reason == "length"
    stop(front, thread)
    assert not core.requests


def test_an_abandoned_compile_is_withdrawn_if_queued_and_kept_if_it_ends(
        core: EngineCore, monkeypatch: pytest.MonkeyPatch) -> None:
    """The manager alone: a request that gives up on a queued compile withdraws it (it never
    runs); one that gives up on a running compile cannot stop it, but what it compiles is
    kept, and the same spec asked for again is not compiled again."""
    may_compile, compiling = threading.Event(), threading.Semaphore(0)
    compiled: list[str] = []
    compile_now = StructuredOutputManager._compile

    def held(self: StructuredOutputManager, params: StructuredOutputsParams) -> Any:
        compiled.append(params.key()[1])
        compiling.release()
        assert may_compile.wait(60), "the test never let the compile run"
        return compile_now(self, params)

    monkeypatch.setattr(StructuredOutputManager, "_compile", held)
    manager = StructuredOutputManager(core.model_path, core.vocab_size, [0],
                                      compile_timeout_s=60.0)
    specs = [StructuredOutputsParams(regex=regex) for regex in ("a{2}b", "b{2}a", "a{3}")]
    jobs = [manager.request(params) for params in specs]
    for _ in range(2):  # both threads have taken a job: the third is queued
        assert compiling.acquire(timeout=30)
    for params, job in zip(specs, jobs):
        manager.release(params, job)
    assert len(manager.compile_threads) == 0  # the queued one withdrawn
    may_compile.set()
    for job in jobs[:2]:
        assert job.finished.wait(30)
    assert sorted(compiled) == ["a{2}b", "b{2}a"]
    for params in specs[:2]:  # from the cache: the abandoned compiles' results were kept
        assert manager.request(params).finished.is_set()
    assert manager.num_compiles == 3 and len(manager.cache) == 2


def test_a_repeated_spec_compiles_once(core: EngineCore, front: Front,
                                       held_compiles: threading.Event) -> None:
    _, thread = run_loop(core, front)
    ids = set(range(1, 6))
    for request_id in ids:  # all before the first compile ends: they wait for the one
        front.send(AddRequest(request_id, [5, 6, request_id], constrained("a{2}b"), True))
    front.send(AddRequest(9, [5, 6], PLAIN, True))
    messages_until(front, lambda seen: finished(seen, 9))
    held_compiles.set()
    seen = messages_until(front, lambda seen: all(finished(seen, i) for i in ids))
    front.send(AddRequest(6, [5, 7], constrained("a{2}b"), True))  # kept in the cache
    seen += messages_until(front, lambda seen: finished(seen, 6))
    stop(front, thread)
    assert manager_for(core).num_compiles == 1
    assert all(text_of(seen, i) == "aab" for i in (*ids, 6))


def test_a_request_aborted_while_its_grammar_compiles_is_forgotten(
        core: EngineCore, front: Front, held_compiles: threading.Event) -> None:
    _, thread = run_loop(core, front)
    front.send(AddRequest(1, [5, 6, 7], constrained(), True))
    front.send(AddRequest(2, [5, 6], PLAIN, True))
    messages_until(front, lambda seen: finished(seen, 2))
    front.send(AbortRequests([1]))
    held_compiles.set()
    front.send(AddRequest(3, [5, 6], PLAIN, True))
    seen = messages_until(front, lambda seen: finished(seen, 3))
    stop(front, thread)
    assert not finished(seen, 1) and seen[-1].stats.num_waiting == 0
    assert not core.requests


def test_a_spec_that_cannot_compile_is_refused_by_the_loop(core: EngineCore,
                                                          front: Front) -> None:
    _, thread = run_loop(core, front)
    front.send(AddRequest(1, [5, 6], constrained("(unclosed"), True))
    front.send(AddRequest(2, [5, 6], PLAIN, True))
    seen = messages_until(front, lambda seen: any(m.refused for m in seen)
                          and finished(seen, 2))
    stop(front, thread)
    [refusal] = [r for m in seen for r in m.refused]
    assert refusal.request_id == 1 and "regex cannot be compiled" in refusal.message


class FakeGrammar:
    def __init__(self, size: int) -> None:
        self.memory_size_bytes = size


def test_the_grammar_cache_is_bounded_in_bytes() -> None:
    cache = GrammarCache(max_bytes=1000)
    keys = [("regex", f"r{i}", False) for i in range(4)]  # 2 characters of key each
    for key in keys[:3]:
        cache.put(key, FakeGrammar(300))
    assert len(cache) == 3 and cache.num_bytes == 906
    assert cache.get(keys[0]) is not None  # now the most recently used
    cache.put(keys[3], FakeGrammar(300))  # drops the least recently used: keys[1]
    assert cache.get(keys[1]) is None and cache.get(keys[0]) is not None
    assert cache.num_bytes == 906
    cache.put(("regex", "big", False), FakeGrammar(2000))  # larger than the bound: not kept
    assert len(cache) == 3 and cache.num_bytes <= 1000
    assert len(GrammarCache(0)) == 0
