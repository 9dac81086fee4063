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
from myvllm.engine.outputs import GenerateProgress, generate_result, request_outputs
from myvllm.engine.sequence import Sequence, SequenceStatus
from myvllm.sample.extras import LogprobsLists
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


# ---------------------------------------------------------------- the pieces, without a model
def test_each_sequence_with_new_tokens_gets_one_output_carrying_them() -> None:
    """request_outputs: one RequestOutput per sequence that got tokens in the step, carrying
    the new tokens, the whole completion so far, whether and why it finished, its prompt's
    length and cache hits, and its own row of the step's logprobs. A sequence that got
    nothing (the surplus token of one that had finished) is left out, and the others after
    it are not. A request leaves the unfinished ones, marked request_finished, with its
    last output only."""
    done, idle = Sequence([1, 2, 3, 4, 5], 4), Sequence([1, 2, 3, 4, 5], 4)
    running = Sequence([1, 2, 3, 4, 5], 4, SamplingParams(prompt_logprobs=0))
    assert running.extras is not None
    running.extras.prompt_logprobs = prompt_rows = LogprobsLists([-1.0] * 4, [[]] * 4, [[]] * 4)
    known = [len(s.token_ids) for s in (done, idle, running)]
    done.append_token(7)
    done.append_token(8)
    done.status, done.finish_reason = SequenceStatus.FINISHED, "stop"
    done.num_cached_prompt_tokens = 4
    idle.status, idle.finish_reason = SequenceStatus.FINISHED, "length"
    running.append_token(9)
    rows = [LogprobsLists([-float(i)], [[i]], [[-float(i)]]) for i in range(3)]
    requests = {s.request_id: [s] for s in (done, idle, running)}
    outs = request_outputs([done, idle, running], known, rows, requests)
    assert [o.request_id for o in outs] == [done.request_id, running.request_id]
    first, second = outs
    assert (first.new_token_ids, first.token_ids, first.finished, first.finish_reason) == (
        [7, 8], [7, 8], True, "stop")
    assert (first.num_prompt_tokens, first.num_cached_tokens, first.request_finished) == (
        5, 4, True)
    assert (second.new_token_ids, second.finished, second.finish_reason) == ([9], False, None)
    assert not second.request_finished and second.num_cached_tokens == 0
    assert first.logprobs is rows[0] and second.logprobs is rows[2]
    # prompt logprobs (asked by running only) come once, with its first output
    assert first.prompt_logprobs is None and second.prompt_logprobs is prompt_rows
    assert running.extras.prompt_logprobs is None
    assert done.request_id not in requests and running.request_id in requests
    (again,) = request_outputs([running], [len(running.token_ids) - 1], None, requests)
    assert again.logprobs is None  # the step has no logprobs: none for any row


def test_generate_result_per_completion_and_without_a_stop_token_in_the_text() -> None:
    """generate()'s dict of a prompt: text, tokens, cache hits and logprobs of completion 0;
    n > 1 adds "outputs", one per completion in order. A request's own stop token that ended
    a completion stays in its token_ids but not in its text."""
    def decode(token_ids: list[int]) -> str:
        return ",".join(map(str, token_ids))

    def completion(index: int, token_ids: list[int], reason: str) -> dict:
        return {"index": index, "token_ids": token_ids, "finish_reason": reason,
                "logprobs": None}

    one = {"seq_id": 0, **completion(0, [5, 6, 9], "stop"), "num_cached_tokens": 4,
           "prompt_logprobs": None}
    assert generate_result(one, None, decode) == {
        "text": "5,6,9", "token_ids": [5, 6, 9], "num_cached_tokens": 4, "logprobs": None,
        "prompt_logprobs": None}
    result = generate_result(one, [9], decode)
    assert (result["text"], result["token_ids"]) == ("5,6", [5, 6, 9]) and "outputs" not in result
    many = {**one, "outputs": [completion(0, [5, 6, 9], "stop"), completion(1, [9, 9], "length")]}
    result = generate_result(many, [9], decode)
    assert result["outputs"] == [
        {"index": 0, "text": "5,6", "token_ids": [5, 6, 9], "finish_reason": "stop",
         "logprobs": None},
        {"index": 1, "text": "9,9", "token_ids": [9, 9], "finish_reason": "length",
         "logprobs": None}]


def test_the_progress_bar_counts_prompts_and_tokens_per_second() -> None:
    """generate()'s progress bar: finished prompts, and the rate of the last prefill step
    (tokens > 0, one token too) and of the last decode step (tokens < 0, one per row), each
    kept until the next step of its kind; use_tqdm=False hides it."""
    assert GenerateProgress(2, enabled=False).bar.disable
    progress = GenerateProgress(3, enabled=True)
    progress.step(num_finished=0, num_tokens=1, elapsed=0.5)
    assert (progress.prefill_tps, progress.decode_tps) == (2.0, 0.0)
    progress.step(num_finished=0, num_tokens=100, elapsed=0.5)
    progress.step(num_finished=2, num_tokens=-8, elapsed=0.25)
    assert (progress.prefill_tps, progress.decode_tps, progress.bar.n) == (200.0, 32.0, 2)
    assert {"prefill=200tok/s", "decode=32tok/s"} <= set(progress.bar.postfix.split(", "))
    progress.close()
    assert progress.bar.disable  # a closed bar draws nothing more
