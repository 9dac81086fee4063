"""The CPU thread policy: how many torch threads an engine on the CPU runs with, and that the
caller's own setting comes back when the engine exits."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch
from helpers_models import tiny_checkpoint

from myvllm import LLM, Config, SamplingParams
from myvllm.worker import cpu_threads
from myvllm.worker.cpu_threads import SMALL_MODEL_HIDDEN, cpu_thread_count


def model_of(hidden_size: int) -> SimpleNamespace:
    return SimpleNamespace(hidden_size=hidden_size)


def test_a_small_model_gets_one_thread_and_a_larger_one_every_core(monkeypatch) -> None:
    monkeypatch.setattr(cpu_threads, "usable_cores", lambda: 8)
    assert cpu_thread_count(Config(), model_of(SMALL_MODEL_HIDDEN - 1)) == 1
    assert cpu_thread_count(Config(), model_of(SMALL_MODEL_HIDDEN)) == 8
    # Tensor-parallel ranks share the cores out; none gets less than one.
    assert cpu_thread_count(Config(tensor_parallel_size=2), model_of(4096)) == 4
    assert cpu_thread_count(Config(tensor_parallel_size=2), model_of(64)) == 1


def test_cpu_threads_overrides_the_rule(monkeypatch) -> None:
    monkeypatch.setattr(cpu_threads, "usable_cores", lambda: 8)
    assert cpu_thread_count(Config(cpu_threads=3), model_of(64)) == 3
    assert cpu_thread_count(Config(cpu_threads=2), model_of(4096)) == 2
    assert cpu_thread_count(Config(cpu_threads=6, tensor_parallel_size=2), model_of(64)) == 3


@pytest.mark.parametrize("bad", [-1, 1.5, "2", True])
def test_bad_cpu_threads_is_a_clear_error(bad) -> None:
    with pytest.raises(ValueError,
                       match=rf"Config.cpu_threads={re.escape(repr(bad))}: allowed: an int >= 0"):
        Config(cpu_threads=bad)


def test_the_engine_runs_with_its_threads_and_gives_the_callers_back() -> None:
    """Inside generate() the tiny model runs on cpu_threads threads; exit() restores the
    count the caller had, so an engine does not change the rest of the process."""
    before = torch.get_num_threads()
    wanted = 2 if before == 1 else 1  # not the caller's count, so that a change shows
    seen: list[int] = []
    llm = LLM(str(tiny_checkpoint("qwen3")), device="cpu", cpu_threads=wanted,
              num_kvcache_blocks=16, block_size=4, max_model_length=64)
    try:
        runner = llm.engine_core.model_runner
        run = runner.run

        def spy(*args, **kwargs):
            seen.append(torch.get_num_threads())
            return run(*args, **kwargs)

        runner.run = spy
        llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    finally:
        llm.exit()
    assert seen and set(seen) == {wanted}
    assert torch.get_num_threads() == before
