"""SamplingParams.n: n completions of one prompt, prefilled once, sharing its full blocks.

The oracles: greedy completions must each equal the n=1 completion (which the model tests
check against HF transformers); the block manager's ref counts must equal the number of
block tables holding each block after every step, with nothing held at the end; seeded
sampling must be reproducible, completion 0 being what n=1 gives with the same seed.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from helpers_blocks import used_block_ids
from helpers_models import tiny_checkpoint

from myvllm import LLM, SamplingParams

BLOCK_SIZE = 4
ENGINE_KW = dict(block_size=BLOCK_SIZE, max_model_length=64, max_num_batched_tokens=128,
                 num_kvcache_blocks=48)
# The tiny llama's distribution is flat enough that sampled completions differ.
MODEL = "llama"


def random_prompt(length: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(1, 255) for _ in range(length)]


def check_blocks(llm: LLM) -> None:
    """Every ref count equals the number of block tables holding the block."""
    manager = llm.scheduler.block_manager
    holders = [0] * len(manager.blocks)
    for seq in (*llm.scheduler.running, *llm.scheduler.waiting):
        for block_id in seq.block_table:
            holders[block_id] += 1
    assert [block.ref_count for block in manager.blocks] == holders


def run(llm: LLM, prompt: list[int], params: SamplingParams
        ) -> tuple[dict[str, Any], list[int]]:
    """Run one request step by step, checking the blocks after each; its finished dict and
    the token counts of the steps."""
    request_id = llm.add_request(prompt, params)
    counts, finished = [], []
    while not llm.is_finished():
        outs, num_tokens = llm.step()
        counts.append(num_tokens)
        finished += outs
        check_blocks(llm)
    assert [out["seq_id"] for out in finished] == [request_id]
    assert not used_block_ids(llm.scheduler.block_manager), "blocks leaked"
    assert llm.engine_core.requests == {}
    return finished[0], counts


@pytest.mark.parametrize("chunked, async_scheduling, caching",
                         [(True, False, True), (False, False, False), (True, True, False)])
def test_greedy_completions_equal_n1_and_the_prompt_is_prefilled_once(
        chunked: bool, async_scheduling: bool, caching: bool) -> None:
    llm = LLM(str(tiny_checkpoint(MODEL)), enable_chunked_prefill=chunked,
              async_scheduling=async_scheduling, enable_prefix_caching=caching, **ENGINE_KW)
    prompt = random_prompt(10)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    shared_blocks = []
    original_step = llm.engine_core.step

    def step_and_look() -> Any:  # after the prefill: the forks' tables
        result = original_step()
        running = list(llm.scheduler.running)
        if len(running) == 3 and not shared_blocks:
            shared_blocks.extend(seq.block_table[:2] for seq in running)
        return result

    llm.engine_core.step = step_and_look  # type: ignore[method-assign]
    out, counts = run(llm, prompt, SamplingParams(temperature=0.0, max_tokens=8,
                                                  ignore_eos=True, n=3))
    # Prompt of 10 tokens in blocks of 4: two full blocks shared, and each completion
    # computes the 2 tokens of the last prompt block itself, in a block of its own.
    assert sum(c for c in counts if c > 0) == 10 + 2 * 2
    assert len(shared_blocks) == 3 and shared_blocks[0] == shared_blocks[1] == shared_blocks[2]
    want = llm.generate([prompt], params, use_tqdm=False)[0]
    assert [c["token_ids"] for c in out["outputs"]] == [want["token_ids"]] * 3
    assert [c["index"] for c in out["outputs"]] == [0, 1, 2]
    assert out["token_ids"] == want["token_ids"]
    assert {c["finish_reason"] for c in out["outputs"]} == {"length"}


def test_generate_keeps_its_shape_for_n1_and_adds_outputs_for_n() -> None:
    llm = LLM(str(tiny_checkpoint(MODEL)), **ENGINE_KW)
    prompts = [random_prompt(5, seed=1), random_prompt(9, seed=2)]
    one, three = llm.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=4),
                                        SamplingParams(temperature=0.0, max_tokens=4, n=3)],
                              use_tqdm=False)
    assert set(one) == {"text", "token_ids", "num_cached_tokens", "logprobs",
                        "prompt_logprobs"}
    assert set(three) == set(one) | {"outputs"}
    assert [set(c) for c in three["outputs"]] == [
        {"index", "text", "token_ids", "finish_reason", "logprobs"}] * 3
    assert three["text"] == three["outputs"][0]["text"]
    # The forks' shared prefix is no prefix-cache hit: they report the first's.
    assert three["num_cached_tokens"] == 0


def test_seeded_completions_are_reproducible_distinct_and_completion_0_is_n1() -> None:
    llm = LLM(str(tiny_checkpoint(MODEL)), **ENGINE_KW)
    prompt = random_prompt(10, seed=3)
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=7, n=2)
    first = llm.generate([prompt], params, use_tqdm=False)[0]["outputs"]
    # Again, now beside other requests in the same batches: the same tokens.
    others = [random_prompt(7, seed=4), random_prompt(12, seed=5)]
    again = llm.generate([others[0], prompt, others[1]],
                         [SamplingParams(temperature=1.0, max_tokens=12), params,
                          SamplingParams(temperature=1.0, max_tokens=12, n=3)],
                         use_tqdm=False)[1]["outputs"]
    assert [c["token_ids"] for c in again] == [c["token_ids"] for c in first]
    assert first[0]["token_ids"] != first[1]["token_ids"], "each draws its own stream"
    single = llm.generate([prompt], SamplingParams(temperature=1.0, max_tokens=12,
                                                   ignore_eos=True, seed=7), use_tqdm=False)
    assert single[0]["token_ids"] == first[0]["token_ids"]
    # Completion 1 draws from seed + 1.
    shifted = llm.generate([prompt], SamplingParams(temperature=1.0, max_tokens=12,
                                                    ignore_eos=True, seed=8), use_tqdm=False)
    assert shifted[0]["token_ids"] == first[1]["token_ids"]


def test_unseeded_completions_draw_independently() -> None:
    llm = LLM(str(tiny_checkpoint(MODEL)), **ENGINE_KW)
    out = llm.generate([random_prompt(10, seed=6)],
                       SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, n=4),
                       use_tqdm=False)[0]
    assert len({tuple(c["token_ids"]) for c in out["outputs"]}) > 1


@pytest.mark.parametrize("chunked", [True, False])
def test_abort_frees_every_completion(chunked: bool) -> None:
    llm = LLM(str(tiny_checkpoint(MODEL)), enable_chunked_prefill=chunked,
              **dict(ENGINE_KW, max_num_batched_tokens=64))
    manager = llm.scheduler.block_manager
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, n=3)
    request_id = llm.add_request(random_prompt(10, seed=7), params)
    for _ in range(3):
        llm.step()
        check_blocks(llm)
    assert len(llm.scheduler.running) == 3 and used_block_ids(manager)
    llm.abort(request_id)
    assert not used_block_ids(manager) and llm.is_finished()
    assert llm.engine_core.requests == {}


def test_abort_while_the_forks_wait_for_the_prefill() -> None:
    """A prompt in chunks of 4: the forks wait for its last chunk; aborted before it, none
    of them ever runs."""
    llm = LLM(str(tiny_checkpoint(MODEL)), **dict(ENGINE_KW, max_num_batched_tokens=4))
    request_id = llm.add_request(random_prompt(10, seed=8),
                                 SamplingParams(temperature=0.0, max_tokens=5, n=3))
    llm.step()
    assert len(llm.scheduler.running) == 1 and not llm.scheduler.waiting
    llm.abort(request_id)
    assert llm.is_finished() and not used_block_ids(llm.scheduler.block_manager)


@pytest.mark.parametrize("async_scheduling",
                         [False, pytest.param(True, marks=pytest.mark.slow)])
def test_preempted_completions_still_give_the_greedy_tokens(async_scheduling: bool) -> None:
    prompt = random_prompt(10, seed=9)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    want = LLM(str(tiny_checkpoint(MODEL)), **ENGINE_KW).generate(
        [prompt], params, use_tqdm=False)[0]["token_ids"]
    # 4 completions of 29 tokens need 2 shared + 4 x 6 blocks; 12 force preemptions.
    llm = LLM(str(tiny_checkpoint(MODEL)), async_scheduling=async_scheduling,
              **dict(ENGINE_KW, num_kvcache_blocks=12))
    preempted = []
    original_preempt = llm.scheduler.preempt

    def preempt(seq: Any) -> None:
        preempted.append(seq.index)
        original_preempt(seq)

    llm.scheduler.preempt = preempt  # type: ignore[method-assign]
    out, _ = run(llm, prompt, SamplingParams(temperature=0.0, max_tokens=20,
                                             ignore_eos=True, n=4))
    assert any(index > 0 for index in preempted), "no completion was preempted"
    assert [c["token_ids"] for c in out["outputs"]] == [want] * 4


@pytest.mark.slow
def test_each_completion_stops_on_its_own() -> None:
    """With an eos, every completion ends at its own first eos (a seeded run without eos
    is the oracle), and max_tokens bounds each."""
    prompt = random_prompt(10, seed=10)
    params = SamplingParams(temperature=1.0, max_tokens=12, seed=11, n=4)
    free = LLM(str(tiny_checkpoint(MODEL)), eos=-1, **ENGINE_KW).generate(
        [prompt], params, use_tqdm=False)[0]["outputs"]
    eos = free[1]["token_ids"][3]
    llm = LLM(str(tiny_checkpoint(MODEL)), eos=eos, **ENGINE_KW)
    out, _ = run(llm, prompt, params)
    lengths = set()
    for got, full in zip(out["outputs"], free, strict=True):
        tokens = full["token_ids"]
        end = tokens.index(eos) + 1 if eos in tokens else len(tokens)
        assert got["token_ids"] == tokens[:end]
        assert got["finish_reason"] == ("stop" if eos in tokens else "length")
        lengths.add(end)
    assert len(lengths) > 1, "the completions should end at different lengths"


def test_logprobs_per_completion() -> None:
    llm = LLM(str(tiny_checkpoint(MODEL)), **ENGINE_KW)
    prompt = random_prompt(10, seed=12)
    params = SamplingParams(temperature=0.0, max_tokens=5, logprobs=2, prompt_logprobs=1)
    want = llm.generate([prompt], params, use_tqdm=False)[0]
    llm = LLM(str(tiny_checkpoint(MODEL)), **ENGINE_KW)  # no prefix-cache hit on it
    got = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=5, logprobs=2,
                                                prompt_logprobs=1, n=3), use_tqdm=False)[0]
    assert got["prompt_logprobs"][0] is None and want["prompt_logprobs"][0] is None
    assert_same_logprobs(got["prompt_logprobs"][1:], want["prompt_logprobs"][1:])
    for completion in got["outputs"]:
        assert completion["token_ids"] == want["token_ids"]
        assert len(completion["logprobs"]) == 5
        assert_same_logprobs(completion["logprobs"], want["logprobs"])


def assert_same_logprobs(got: list[dict[int, float]], want: list[dict[int, float]]) -> None:
    assert len(got) == len(want)
    for mine, theirs in zip(got, want, strict=True):
        assert mine.keys() == theirs.keys()
        assert list(mine.values()) == pytest.approx(list(theirs.values()), abs=1e-5)


def test_step_outputs_carry_each_completion_index() -> None:
    llm = LLM(str(tiny_checkpoint(MODEL)), **ENGINE_KW)
    request_id = llm.add_request(random_prompt(6, seed=13),
                                 SamplingParams(temperature=0.0, max_tokens=3, n=2,
                                                ignore_eos=True))
    seen: dict[int, list[int]] = {0: [], 1: []}
    ends = []
    while not llm.is_finished():
        for out in llm.step_outputs()[0]:
            assert out.request_id == request_id
            seen[out.index] += out.new_token_ids
            ends.append(out.request_finished)
    assert len(seen[0]) == len(seen[1]) == 3 and seen[0] == seen[1]
    assert ends[-1] and not any(ends[:-1]), "the request ends with its last output"


@pytest.mark.parametrize("bad", [0, -1, 129, 1.5, True, "2"])
def test_bad_n_is_refused(bad: Any) -> None:
    with pytest.raises(ValueError, match=r"SamplingParams.n=.*: allowed: an int in \[1, 128\]"):
        SamplingParams(n=bad)


def test_for_completion_derives_the_seeds() -> None:
    params = SamplingParams(seed=2**64 - 1, n=3)
    assert [params.for_completion(i).seed for i in range(3)] == [2**64 - 1, 0, 1]
    assert params.for_completion(2).n == 1
    assert SamplingParams(n=2).for_completion(1).seed is None
