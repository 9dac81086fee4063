"""The engine core's busy loop (core_process.EngineCoreProc), driven over its real sockets.

The test plays the front end: it binds the two ZeroMQ sockets, runs the loop of an in-process
EngineCore in a thread, and sends it messages as AsyncLLM does. So what the loop does with
each message can be seen from inside (the core, its scheduler) and from outside (what comes
back on the output socket).
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from helpers_models import tiny_checkpoint
from myvllm import Config, SamplingParams
from myvllm.engine.core import EngineCore
from myvllm.serving.core_messages import (AbortCompletion, AbortRequests, AddRequest, CoreDead,
                                         CoreMessage, CoreOutputs, Shutdown)
from myvllm.serving.core_process import EngineCoreProc, abort_all, kv_cache_usage
from myvllm.engine.startup import resolve_engine

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


class Front:
    """The front end's side of the two sockets."""

    def __init__(self, tmp_path: Path) -> None:
        self.context: zmq.Context[Any] = zmq.Context()
        self.input = self.context.socket(zmq.PUSH)
        self.input_address = f"ipc://{tmp_path}/input"
        self.input.bind(self.input_address)
        self.output = self.context.socket(zmq.PULL)
        self.output_address = f"ipc://{tmp_path}/output"
        self.output.bind(self.output_address)
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(CoreMessage)

    def send(self, message: Any) -> None:
        self.input.send(self.encoder.encode(message))

    def receive(self, timeout_ms: int = 60_000) -> Any:
        assert self.output.poll(timeout_ms), "the core sent nothing"
        return self.decoder.decode(self.output.recv())

    def until_finished(self, request_ids: set[int]) -> dict[int, list[int]]:
        """Every output until each of request_ids finished: their tokens, by request."""
        tokens: dict[int, list[int]] = {i: [] for i in request_ids}
        done: set[int] = set()
        while done != request_ids:
            message = self.receive()
            assert isinstance(message, CoreOutputs), message
            for out in message.outputs:
                tokens[out.request_id] += out.new_token_ids
                if out.finish_reason is not None:
                    done.add(out.request_id)
        return tokens

    def close(self) -> None:
        self.input.close(linger=0)
        self.output.close(linger=0)
        self.context.term()


@pytest.fixture(scope="module")
def core() -> Iterator[EngineCore]:
    resolved = resolve_engine(Config(model=str(tiny_checkpoint("qwen3")), num_kvcache_blocks=64,
                                     max_model_length=128))
    core = EngineCore(resolved.config, resolved.model_path)
    yield core
    core.shutdown()


@pytest.fixture
def front(tmp_path: Path) -> Iterator[Front]:
    front = Front(tmp_path)
    yield front
    front.close()


def run_loop(core: EngineCore, front: Front) -> tuple[EngineCoreProc, threading.Thread]:
    proc = EngineCoreProc(core, front.input_address, front.output_address)
    errors: list[BaseException] = []

    def target() -> None:
        try:
            proc.run_busy_loop()
        except BaseException as e:  # the test reads it below
            errors.append(e)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.errors = errors  # type: ignore[attr-defined]
    return proc, thread


def stop(front: Front, thread: threading.Thread) -> None:
    front.send(Shutdown())
    thread.join(30)
    assert not thread.is_alive(), "the busy loop did not stop on Shutdown"


def test_requests_in_tokens_out_one_message_per_step(core: EngineCore, front: Front) -> None:
    _, thread = run_loop(core, front)
    prompts = {7: [5, 6, 7], 8: [9, 10, 11, 12]}
    for request_id, prompt in prompts.items():
        front.send(AddRequest(request_id, prompt, GREEDY, True))
    tokens = front.until_finished(set(prompts))
    stop(front, thread)
    # The same tokens as the core gives in-process, by the front end's own ids.
    expected = {}
    for request_id, prompt in prompts.items():
        core_id = core.add_request(prompt, GREEDY)
        expected[core_id] = request_id
    alone: dict[int, list[int]] = {i: [] for i in prompts}
    while core.has_unfinished_requests():
        for out in core.step()[0]:
            alone[expected[out.request_id]] += out.new_token_ids
    assert tokens == alone and all(len(t) == 6 for t in tokens.values())


def test_streamed_flag_reaches_the_sequence(core: EngineCore, front: Front,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[bool] = []
    add_request = core.add_request

    def spy(token_ids: Any, params: Any, *, streamed: bool = True) -> int:
        request_id = add_request(token_ids, params, streamed=streamed)
        seen.append(core.requests[request_id][0].streamed)
        return request_id

    monkeypatch.setattr(core, "add_request", spy)
    _, thread = run_loop(core, front)
    front.send(AddRequest(1, [5, 6], GREEDY, False))
    front.send(AddRequest(2, [5, 7], GREEDY, True))
    front.until_finished({1, 2})
    stop(front, thread)
    assert seen == [False, True]


def test_bad_request_is_refused_and_the_loop_goes_on(core: EngineCore, front: Front) -> None:
    _, thread = run_loop(core, front)
    front.send(AddRequest(1, [], GREEDY, True))  # empty prompt
    front.send(AddRequest(2, [5] * 200, GREEDY, True))  # longer than max_model_length
    front.send(AddRequest(3, [5, 6], GREEDY, True))
    refused = {}
    tokens: list[int] = []
    while len(tokens) < 6:
        message = front.receive()
        refused.update({r.request_id: r for r in message.refused})
        tokens += [t for out in message.outputs for t in out.new_token_ids]
    stop(front, thread)
    assert set(refused) == {1, 2}
    assert refused[1].error_type == "ValueError" and "empty prompt" in refused[1].message
    assert "max_model_length" in refused[2].message


def test_abort_frees_the_blocks_and_the_stats_say_so(core: EngineCore, front: Front) -> None:
    _, thread = run_loop(core, front)
    front.send(AddRequest(1, [5, 6, 7], SamplingParams(max_tokens=100, ignore_eos=True), True))
    while not (message := front.receive()).outputs:
        pass
    assert message.stats.num_running == 1 and message.stats.kv_cache_usage > 0
    front.send(AbortRequests([1, 999]))  # an unknown id is ignored
    while (message := front.receive()).stats.num_running:
        pass
    assert message.stats.kv_cache_usage == 0.0
    stop(front, thread)
    assert not core.requests


def test_a_prefill_counts_as_running_while_its_step_runs(core: EngineCore, front: Front,
                                                        monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    """A long prefill (a minute on a CPU) is reported running, its blocks in use, before
    its step ends: the queues go out as the step starts. The step here waits for the test,
    so "during" needs no clock."""
    step_may_end = threading.Event()
    run = core.model_runner.run

    def held_run(*args: Any) -> Any:
        assert step_may_end.wait(60), "the test never let the step end"
        return run(*args)

    monkeypatch.setattr(core.model_runner, "run", held_run)
    _, thread = run_loop(core, front)
    front.send(AddRequest(1, list(range(5, 69)), GREEDY, True))
    message = front.receive()  # sent while the prefill's step is held
    assert isinstance(message, CoreOutputs) and not message.outputs
    assert message.stats.num_running == 1 and message.stats.num_waiting == 0
    assert message.stats.kv_cache_usage > 0
    step_may_end.set()
    assert front.until_finished({1})[1]
    stop(front, thread)


def test_n_completions_come_by_index_and_each_can_be_aborted(core: EngineCore,
                                                             front: Front) -> None:
    """n = 3: every output names its completion; aborting completion 1 (a stop string, at
    the front end) stops it alone, and aborting the last one running ends the request."""
    proc, thread = run_loop(core, front)
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True, n=3)
    front.send(AddRequest(4, [5, 6, 7, 8, 9], params, True))
    tokens: dict[int, list[int]] = {0: [], 1: [], 2: []}
    while len(tokens[1]) < 2:
        for out in front.receive().outputs:
            assert out.request_id == 4
            tokens[out.index] += out.new_token_ids
    front.send(AbortCompletion(4, 1))
    while (message := front.receive()).stats.num_running != 2:
        pass
    front.send(AbortCompletion(4, 0))
    front.send(AbortCompletion(4, 2))
    while (message := front.receive()).stats.num_running:
        pass
    assert message.stats.kv_cache_usage == 0.0
    stop(front, thread)
    assert not core.requests and proc._core_ids == proc._front_ids == {}
    assert tokens[0][:2] == tokens[1][:2]  # greedy: the same tokens


def test_shutdown_aborts_what_is_left(core: EngineCore, front: Front) -> None:
    _, thread = run_loop(core, front)
    front.send(AddRequest(1, [5, 6, 7], SamplingParams(max_tokens=100, ignore_eos=True), True))
    while not front.receive().outputs:
        pass
    stop(front, thread)
    assert not core.requests and not core.has_unfinished_requests()
    assert kv_cache_usage(core.scheduler.block_manager) == 0.0


def test_the_loop_steps_with_the_heap_frozen(core: EngineCore, front: Front,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The busy loop runs its steps inside frozen_heap: no full garbage collection walks the
    engine's objects between two tokens of a stream (see utils/gc_freeze.py)."""
    step = core.step
    frozen: list[bool] = []

    def spy() -> Any:
        # The core existed before the loop started, so the loop's freeze took it out of the
        # collector's lists. (A freeze count above 0 alone would also be true after a
        # library's own early freeze, with the core still walked.)
        if not frozen:
            frozen.append(all(o is not core for o in gc.get_objects()))
        return step()

    monkeypatch.setattr(core, "step", spy)
    _, thread = run_loop(core, front)
    front.send(AddRequest(1, [5, 6], GREEDY, True))
    front.until_finished({1})
    stop(front, thread)
    assert frozen == [True]


def test_a_failing_step_sends_core_dead_and_ends_the_loop(core: EngineCore, front: Front,
                                                          monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    def broken_step() -> Any:
        raise RuntimeError("boom in a step")

    monkeypatch.setattr(core, "step", broken_step)
    _, thread = run_loop(core, front)
    front.send(AddRequest(1, [5, 6], GREEDY, True))
    message = front.receive()
    assert isinstance(message, CoreDead) and "boom in a step" in message.message
    thread.join(30)
    assert not thread.is_alive()
    assert isinstance(thread.errors[0], RuntimeError)  # type: ignore[attr-defined]
    abort_all(core)


@pytest.mark.slow  # ~10 s here: a core process that loads torch and fails
def test_a_core_that_fails_to_start_is_a_clear_error(tmp_path: Path) -> None:
    """The front end checks the settings itself; what only the core finds (here a tensor
    missing from the checkpoint) comes back from AsyncLLM(...) with the core's own error,
    and the core process is gone."""
    import multiprocessing
    import shutil

    from safetensors.torch import load_file, save_file

    from myvllm.serving.async_llm import AsyncLLM

    path = tmp_path / "broken"
    shutil.copytree(tiny_checkpoint("qwen3"), path)
    tensors = load_file(path / "model.safetensors")
    tensors.pop("model.layers.1.self_attn.k_proj.weight")
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(RuntimeError, match="engine core failed to start") as info:
        AsyncLLM(Config(model=str(path), num_kvcache_blocks=64))
    assert "model.layers.1.self_attn.k_proj.weight" in str(info.value)
    assert [p for p in multiprocessing.active_children() if p.name == "myvllm-engine-core"] == []
