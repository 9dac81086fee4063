"""Overlapped ("async") scheduling gives the tokens of the plain loop, on the CPU.

With async_scheduling the engine queues step N+1 before it reads step N's tokens: sequences
count a pending token, the runner feeds it from the device, a sequence that stops on eos
gets one surplus step. The oracle is the same engine with async_scheduling=False, under the
conditions where that bookkeeping can go wrong: preemption in a tiny KV pool, eos, prefix
hits on blocks completed by decoding, seeded sampling. (tests/core/test_scheduler_properties.py
checks the same with a fake model over random workloads.)
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from helpers_models import record_preemptions, tiny_checkpoint
from helpers_overlap import overlapped, record_overlap
from test_engine import random_prompts

from myvllm import LLM, Config, SamplingParams
from helpers_blocks import used_block_ids

ENGINE_KW = dict(block_size=4, max_model_length=64, max_num_batched_tokens=64,
                 max_num_sequences=4)


def engine(async_scheduling: bool, **overrides: Any) -> LLM:
    kw = {**ENGINE_KW, **overrides}
    return LLM(str(tiny_checkpoint("qwen3")), async_scheduling=async_scheduling, **kw)


def test_async_gives_the_sync_tokens_with_preemption_and_eos() -> None:
    prompts = random_prompts([5, 11, 17, 3, 9, 14], seed=3)
    max_tokens = [12, 20, 7, 25, 16, 10]
    # Find a token the model emits often, and make it eos, so some sequences stop early.
    probe = engine(False, num_kvcache_blocks=64, eos=-1)
    greedy = [SamplingParams(temperature=0.0, max_tokens=n) for n in max_tokens]
    counts = Counter(t for o in probe.generate(prompts, greedy, use_tqdm=False)
                     for t in o["token_ids"][1:])
    eos = counts.most_common(1)[0][0]

    results = {}
    for mode in (False, True):
        # ~30 blocks would be needed at the peak; 14 force preemptions.
        llm = engine(mode, num_kvcache_blocks=14, eos=eos)
        preempted = record_preemptions(llm)
        calls = record_overlap(llm)
        outs = llm.generate(prompts, greedy, use_tqdm=False)
        assert preempted, "the small KV pool was meant to force a preemption"
        assert overlapped(calls) == mode
        manager = llm.scheduler.block_manager
        assert len(manager.free_block_ids) == len(manager.blocks), "a block leaked"
        assert not llm.scheduler.running and not llm.scheduler.waiting
        results[mode] = outs
        llm.exit()
    sync, overlapping = results[False], results[True]
    assert [o["token_ids"] for o in overlapping] == [o["token_ids"] for o in sync]
    assert any(len(o["token_ids"]) < n for o, n in zip(sync, max_tokens)), "no eos stop"
    assert all(o["token_ids"][-1] == eos or len(o["token_ids"]) == n
               for o, n in zip(overlapping, max_tokens))


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_blocks_completed_while_decoding_are_shared_later(async_scheduling: bool) -> None:
    """A prompt equal to an earlier prompt + completion hits the blocks that decoding
    filled. Under async scheduling those are registered only once their last token is read
    back (Scheduler.postprocess), so this checks that late registration."""
    llm = engine(async_scheduling, num_kvcache_blocks=64)
    prompt = random_prompts([6], seed=8)[0]
    params = SamplingParams(temperature=0.0, max_tokens=11, ignore_eos=True)
    first = llm.generate([prompt], params, use_tqdm=False)[0]
    follow_up = prompt + first["token_ids"] + [5]  # 18 tokens
    second = llm.generate([follow_up], params, use_tqdm=False)[0]
    # The first sequence had 6 + 11 = 17 tokens, the K/V of 16 written (never that of its
    # last token): 4 full blocks. The 4th was completed by the last step, with its last
    # token still pending when that step was scheduled: only the late registration in
    # postprocess can make it findable.
    assert second["num_cached_tokens"] == 16
    cold = engine(async_scheduling, num_kvcache_blocks=64, enable_prefix_caching=False)
    assert second["token_ids"] == cold.generate([follow_up], params, use_tqdm=False)[0]["token_ids"]


def test_seeded_sampling_is_the_same_with_async_scheduling() -> None:
    prompts = random_prompts([6, 9, 4], seed=2)
    params = [SamplingParams(temperature=1.0, max_tokens=n, seed=100 + n) for n in (9, 13, 5)]
    outs = [[o["token_ids"] for o in engine(mode, num_kvcache_blocks=64, eos=-1).generate(
        prompts, params, use_tqdm=False)] for mode in (False, True)]
    assert outs[0] == outs[1]


def test_step_by_step_with_async_scheduling() -> None:
    """add_request + step(): each step reports the step queued before it; all finish."""
    llm = engine(True, num_kvcache_blocks=64)
    prompts = random_prompts([6, 10, 3], seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    expected = engine(False, num_kvcache_blocks=64).generate(prompts, params, use_tqdm=False)
    seq_ids = [llm.add_request(p, params) for p in prompts]
    assert llm.step() == ([], 0)  # the prefill is queued, nothing is read back yet
    assert not llm.is_finished()
    outputs: dict[int, dict] = {}
    reported = []
    while not llm.is_finished():
        finished, num_tokens = llm.step()
        reported.append(num_tokens)
        outputs.update({out["seq_id"]: out for out in finished})
    assert reported[0] == sum(len(p) for p in prompts)  # the prefill, read one call later
    assert [outputs[i]["token_ids"] for i in seq_ids] == [o["token_ids"] for o in expected]
    assert llm.step() == ([], 0)


def test_async_scheduling_must_be_a_bool_or_none() -> None:
    # Any tensor-parallel size takes it (tests/engine/test_tensor_parallel.py runs it).
    assert Config(async_scheduling=True, tensor_parallel_size=2).async_scheduling is True
    with pytest.raises(ValueError, match="async_scheduling='yes': allowed: True or False"):
        Config(async_scheduling="yes")


def test_interrupted_generate_leaves_an_async_engine_usable() -> None:
    """Ctrl-C while a step is in flight: the step is abandoned, every block comes back, and
    the next generate() gives the tokens of a fresh engine."""
    prompts = random_prompts([7, 12, 5], seed=6)
    params = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)
    expected = engine(False, num_kvcache_blocks=64).generate(prompts, params, use_tqdm=False)

    llm = engine(True, num_kvcache_blocks=64)
    run = llm.model_runner.run
    calls = 0

    def interrupted_run(*args: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 4:  # a decode step, queued while the previous one is in flight
            raise KeyboardInterrupt
        return run(*args)

    llm.model_runner.run = interrupted_run  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine_core.in_flight.step is None and llm.is_finished()
    manager = llm.scheduler.block_manager
    assert len(manager.free_block_ids) == len(manager.blocks) and not used_block_ids(manager)
    llm.model_runner.run = run  # type: ignore[method-assign]
    again = llm.generate(prompts, params, use_tqdm=False)
    assert [o["token_ids"] for o in again] == [o["token_ids"] for o in expected]


def test_a_request_outside_the_interrupted_generate_recomputes_its_pending_token() -> None:
    """A request added with add_request is in flight when a generate() call is interrupted:
    its pending token is dropped (Sequence.drop_pending_tokens), it is recomputed, and the
    request still finishes with the tokens it gets alone. (Block size 1: every token starts
    a block, the case where block bookkeeping off by one token shows first.)"""
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompt, other = random_prompts([6, 4], seed=9)
    alone = engine(False, num_kvcache_blocks=64).generate([prompt], params, use_tqdm=False)

    llm = engine(True, num_kvcache_blocks=64, block_size=1)
    seq_id = llm.add_request(prompt, params)
    llm.step()
    llm.step()  # its first decode step is in flight now
    run = llm.model_runner.run

    def interrupted_run(*args: Any) -> Any:
        raise KeyboardInterrupt

    llm.model_runner.run = interrupted_run  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        llm.generate([other], params, use_tqdm=False)
    llm.model_runner.run = run  # type: ignore[method-assign]
    outputs = {}
    while not llm.is_finished():
        finished, _ = llm.step()
        outputs.update({out["seq_id"]: out for out in finished})
    assert outputs[seq_id]["token_ids"] == alone[0]["token_ids"]
    manager = llm.scheduler.block_manager
    assert len(manager.free_block_ids) == len(manager.blocks)
