"""LLMEngine.step_outputs and abort: what a streaming caller (the server) builds on.

step_outputs reports, step by step, the tokens each request received; their concatenation
must be what generate() returns, with the right finish_reason. abort frees a request's
blocks at once, wherever it is, and it then receives nothing more.
"""

from __future__ import annotations

import random

import pytest
from helpers_models import tiny_checkpoint

from myvllm import LLM, SamplingParams
from myvllm.engine.batch import RequestOutput
from helpers_blocks import used_block_ids

ENGINE_KW = dict(block_size=4, max_model_length=64, max_num_batched_tokens=128,
                 num_kvcache_blocks=32)


def prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randint(1, 255) for _ in range(n)] for n in lengths]


def drain(llm: LLM) -> dict[int, list[RequestOutput]]:
    """Step until idle; every RequestOutput, by request id, in order."""
    seen: dict[int, list[RequestOutput]] = {}
    while not llm.is_finished():
        outputs, _ = llm.step_outputs()
        for out in outputs:
            assert out.new_token_ids, "an output always carries new tokens"
            seen.setdefault(out.request_id, []).append(out)
    return seen


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_streamed_tokens_add_up_to_generate(async_scheduling: bool) -> None:
    llm = LLM(str(tiny_checkpoint("qwen3")), async_scheduling=async_scheduling, **ENGINE_KW)
    batch = prompts([5, 9, 3])
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (4, 7, 1)]
    expected = llm.generate(batch, params, use_tqdm=False)
    ids = [llm.add_request(p, sp) for p, sp in zip(batch, params)]
    seen = drain(llm)
    for request_id, want, sp in zip(ids, expected, params):
        outs = seen[request_id]
        assert sum((o.new_token_ids for o in outs), []) == want["token_ids"]
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        assert outs[-1].finish_reason == "length" and outs[-1].token_ids == want["token_ids"]
        assert all(o.finish_reason is None for o in outs[:-1])
        assert outs[-1].num_prompt_tokens == len(batch[ids.index(request_id)])
        assert len(outs) == sp.max_tokens  # one output per sampled token
    assert llm.engine_core.requests == {}


def test_finish_reason_stop_on_eos() -> None:
    path = str(tiny_checkpoint("qwen3"))
    batch = prompts([6], seed=1)
    free_run = LLM(path, eos=-1, **ENGINE_KW).generate(
        batch, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)[0]["token_ids"]
    eos = free_run[3]
    llm = LLM(path, eos=eos, **ENGINE_KW)
    request_id = llm.add_request(batch[0], SamplingParams(temperature=0.0, max_tokens=8))
    last = drain(llm)[request_id][-1]
    assert last.finished and last.finish_reason == "stop"
    assert last.token_ids == free_run[: free_run.index(eos) + 1]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_abort_frees_blocks_at_once_and_silences_the_request(async_scheduling: bool) -> None:
    llm = LLM(str(tiny_checkpoint("llama")), async_scheduling=async_scheduling, **ENGINE_KW)
    bm = llm.scheduler.block_manager
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    keep, drop = (llm.add_request(p, params) for p in prompts([7, 11], seed=2))
    for _ in range(3):
        llm.step_outputs()
    dropped = llm.engine_core.requests[drop][0]
    assert dropped.block_table, "the request to abort holds blocks by now"
    llm.abort(drop)
    assert not dropped.block_table and dropped.finish_reason == "abort"
    assert dropped not in llm.scheduler.running and dropped not in llm.scheduler.waiting
    llm.abort(drop)  # twice, and unknown ids: nothing happens
    llm.abort(10**9)
    seen = drain(llm)
    assert drop not in seen
    assert seen[keep][-1].finished and len(seen[keep][-1].token_ids) == 20
    assert len(bm.free_block_ids) == len(bm.blocks) and not used_block_ids(bm)


def test_abort_of_a_waiting_request() -> None:
    llm = LLM(str(tiny_checkpoint("qwen3")), **ENGINE_KW)
    request_id = llm.add_request(prompts([5])[0], SamplingParams(max_tokens=3))
    llm.abort(request_id)
    assert llm.is_finished() and llm.step_outputs() == ([], 0)
