"""Tensor parallelism on the CPU: two processes over gloo give the tokens of one.

Also with async scheduling (the workers read each pending token from their copy of the
sampled-token pool, which rank 0 broadcasts), and the workers' lifetime: they are gone
after exit() and after a failed start-up.
"""

from __future__ import annotations

import multiprocessing
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from helpers_models import record_preemptions, tiny_checkpoint
from safetensors.torch import load_file, save_file
from test_engine import GREEDY, random_prompts

from myvllm import LLM, SamplingParams

pytestmark = pytest.mark.slow


def workers_alive(llm: LLM) -> list[bool]:
    assert llm.engine_core.workers is not None
    return [p.is_alive() for p in llm.engine_core.workers.worker_processes]


# Llama only: Qwen3's TP2 tokens are checked against TP1 by the stronger tests below
# (asynchronous, preempted, sampled and chunked rows; logprobs), each its own TP2 engine.
@pytest.mark.parametrize("kind", ["llama"])
def test_tp2_gives_the_tokens_of_tp1(kind: str) -> None:
    path = str(tiny_checkpoint(kind))
    prompts = random_prompts([7, 13, 4])
    kwargs = dict(block_size=4, max_model_length=64, max_num_batched_tokens=128)
    single = LLM(path, **kwargs).generate(prompts, GREEDY, use_tqdm=False)
    llm = LLM(path, tensor_parallel_size=2, **kwargs)
    assert workers_alive(llm) == [True]
    sharded = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o["token_ids"] for o in sharded] == [o["token_ids"] for o in single]
    llm.exit()
    assert workers_alive(llm) == [False]
    llm.exit()  # idempotent


def record_pending_rows(llm: LLM) -> list[tuple[bool, int]]:
    """(is_prefill, rows whose token is still pending) of every step rank 0 runs."""
    steps: list[tuple[bool, int]] = []
    run = llm.model_runner.run

    def recording_run(seqs: Any, is_prefill: bool) -> Any:
        steps.append((is_prefill, sum(seq.num_pending_tokens > 0 for seq in seqs)))
        return run(seqs, is_prefill)

    llm.model_runner.run = recording_run  # type: ignore[method-assign]
    return steps


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked_budget_12", "prefill_first"])
def test_tp2_async_gives_the_tokens_of_tp1_sync(chunked: bool) -> None:
    """Greedy rows that stop on eos or max_tokens, seeded sampled rows, and preemptions (a
    pool of 14 blocks where ~29 would be needed at the peak): a preempted sequence is
    prefilled again over all its tokens, which the workers get once its pending token is
    known. With a budget of 12 tokens, prompts go in chunks beside decode rows whose token is
    still pending."""
    path = str(tiny_checkpoint("qwen3"))
    prompts = random_prompts([7, 13, 4, 21, 9], seed=5)
    max_tokens = [12, 7, 16, 10, 14]
    kwargs: dict[str, Any] = dict(block_size=4, max_model_length=64, num_kvcache_blocks=14,
                                  enable_chunked_prefill=chunked,
                                  max_num_batched_tokens=12 if chunked else 128)
    # A token the model emits often becomes eos, so that some sequences stop early.
    probe = LLM(path, eos=-1, async_scheduling=False, **kwargs).generate(
        prompts, [SamplingParams(temperature=0.0, max_tokens=n) for n in max_tokens],
        use_tqdm=False)
    eos = Counter(t for o in probe for t in o["token_ids"][1:]).most_common(1)[0][0]
    params = [SamplingParams(temperature=0.0, max_tokens=n) for n in max_tokens[:3]]
    params += [SamplingParams(temperature=1.0, top_p=0.9, seed=7 + n, max_tokens=n)
               for n in max_tokens[3:]]
    single = LLM(path, eos=eos, async_scheduling=False, **kwargs).generate(
        prompts, params, use_tqdm=False)

    llm = LLM(path, eos=eos, tensor_parallel_size=2, async_scheduling=True, **kwargs)
    assert llm.async_scheduling and llm.model_runner.broadcast_sampled
    steps = record_pending_rows(llm)
    preempted = record_preemptions(llm)
    sharded = llm.generate(prompts, params, use_tqdm=False)
    llm.exit()
    assert preempted, "the small KV pool was meant to force a preemption"
    assert [o["token_ids"] for o in sharded] == [o["token_ids"] for o in single]
    assert any(len(o["token_ids"]) < n for o, n in zip(single[:3], max_tokens)), "no eos stop"
    # The workers had to read pending tokens, in mixed steps where prompts go in chunks.
    assert any(pending for _, pending in steps)
    if chunked:
        assert any(is_prefill and pending for is_prefill, pending in steps)
    assert multiprocessing.active_children() == []


def test_no_worker_left_after_a_start_up_error(tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(tiny_checkpoint("qwen3"), broken)
    tensors = load_file(broken / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(Exception, match="down_proj"):
        LLM(str(broken), tensor_parallel_size=2, max_model_length=64,
            max_num_batched_tokens=128)
    assert multiprocessing.active_children() == []


def test_tp_size_must_divide_the_heads() -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size=3"):
        LLM(str(tiny_checkpoint("qwen3")), tensor_parallel_size=3)
    assert multiprocessing.active_children() == []


def test_tp2_logprobs_match_tp1() -> None:
    """Prompt logprobs run the LM head over prompt rows, a collective: every rank must pick
    the same rows from what its copy of a sequence carries (extras.needs_prompt_logprobs), also in
    chunks (a budget of 12 tokens)."""
    path = str(tiny_checkpoint("qwen3"))
    prompts = random_prompts([7, 30])
    kwargs = dict(block_size=4, max_model_length=64, max_num_batched_tokens=12)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2,
                            prompt_logprobs=2)
    single = LLM(path, **kwargs).generate(prompts, params, use_tqdm=False)
    llm = LLM(path, tensor_parallel_size=2, **kwargs)
    sharded = llm.generate(prompts, params, use_tqdm=False)
    llm.exit()
    for one, two in zip(single, sharded):
        assert two["token_ids"] == one["token_ids"]
        for key in ("logprobs", "prompt_logprobs"):
            assert len(two[key]) == len(one[key])
            for a, b in zip(one[key], two[key]):
                assert (a is None) == (b is None)
                if a is not None:
                    assert a.keys() == b.keys()
                    assert list(a.values()) == pytest.approx(list(b.values()), abs=1e-4)
