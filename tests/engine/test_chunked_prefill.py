"""Chunked prefill end to end on the CPU: prompts many times the token budget, mixed steps of
prompt chunks and decode rows, against HF transformers' greedy tokens.

The budget (max_num_batched_tokens) is set far below the prompts so that every prompt runs in
several chunks, beside sequences that decode; prefix caching and preemption must keep
working across chunk boundaries.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
from helpers_models import hf_greedy, load_hf_reference, random_prompts, tiny_checkpoint

from myvllm import LLM, SamplingParams
from myvllm.worker.padded_steps import pad_steps
from helpers_blocks import used_block_ids

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)




def budget_steps(llm: LLM, prompts: list[list[int]], params: SamplingParams
                 ) -> tuple[dict[int, list[int]], list[int]]:
    """Drive the engine by step(); returns the outputs by request id and every step's count."""
    ids = [llm.add_request(p, params) for p in prompts]
    outputs: dict[int, list[int]] = {}
    counts = []
    while not llm.is_finished():
        finished, n = llm.step()
        counts.append(n)
        outputs.update({out["seq_id"]: out["token_ids"] for out in finished})
    return {i: outputs[i] for i in ids}, counts


@pytest.mark.parametrize("kind", ["qwen3", "llama3"])
def test_prompts_many_times_the_budget_match_transformers(kind: str) -> None:
    path = tiny_checkpoint(kind)
    prompts = random_prompts([57, 3, 41, 9, 62], seed=1)
    llm = LLM(str(path), block_size=4, max_model_length=96, max_num_batched_tokens=12,
              max_num_sequences=4)
    outputs, counts = budget_steps(llm, prompts, GREEDY)
    hf = load_hf_reference(path)
    for prompt, tokens in zip(prompts, outputs.values()):
        assert tokens == hf_greedy(hf, prompt, GREEDY.max_tokens)
    # No step computed more than the budget; some steps mixed chunks with decode rows.
    assert all(abs(n) <= 12 for n in counts) and max(counts) == 12
    assert any(n < 0 for n in counts)  # and pure decode steps came once the prompts were in


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_padded_chunked_steps_match_transformers(async_scheduling: bool) -> None:
    """The GPU's way of running chunked steps, switched on here: steps padded to fixed sizes
    on fixed buffers, attention launched from a tile map (what a CUDA graph replays) with
    long tiles split along their keys, decode rows beside chunks (the decode kernel's), and
    prefix hits; steps larger than the largest size run as before. Same tokens as HF."""
    path = tiny_checkpoint("qwen3")
    base = random_prompts([24], seed=5)[0]
    prompts = [base + p for p in random_prompts([56, 2, 17], seed=6)] + random_prompts([5])
    llm = LLM(str(path), block_size=4, max_model_length=96, max_num_batched_tokens=40,
              max_num_sequences=4, max_prefill_tokens_while_decoding=8,
              async_scheduling=async_scheduling)
    padded = pad_steps(llm.model_runner.inputs, chunk_tiles=(16, 16), max_chunk_tokens=32)
    assert padded.chunk_sizes == [16, 32]
    padded.split_key_tiles = 2  # cut every tile that sees 32 keys or more (split-K)
    sizes = []
    prefill = padded.prefill
    mixed = []  # padded steps with one-token rows (the decode kernel's) beside chunks
    pending_steps = []  # padded steps with tokens still on the device
    def spy(ids, pending, positions, slots, cu_q, *args):  # noqa: ANN001, ANN202
        step = prefill(ids, pending, positions, slots, cu_q, *args)
        if pending:
            pending_steps.append(pending)
        sizes.append((len(positions), step.input_ids.size(0)))
        lengths = [b - a for a, b in zip(cu_q, cu_q[1:])]
        mixed.append(1 in lengths and max(lengths) > 1)
        return step
    padded.prefill = spy  # type: ignore[method-assign]
    outputs, counts = budget_steps(llm, prompts, GREEDY)
    # A second call: short steps, one of them with a prefix hit on the first call's blocks.
    later = [random_prompts([9], seed=7)[0], base + [3, 1, 4]]
    later_outputs = llm.generate(later, GREEDY, use_tqdm=False)
    hf = load_hf_reference(path)
    for prompt, tokens in zip(prompts + later, [*outputs.values(),
                                                *(o["token_ids"] for o in later_outputs)]):
        assert tokens == hf_greedy(hf, prompt, GREEDY.max_tokens)
    assert later_outputs[1]["num_cached_tokens"] == 24
    assert any(n > 32 for n in counts)  # some steps too large to pad ran unpadded
    assert any(real < padded for real, padded in sizes)  # and padded ones ran with padding
    assert any(mixed)
    if async_scheduling:  # decode rows read their token from the device's pool
        assert pending_steps


def test_long_prompt_with_a_prefix_hit_and_async_scheduling() -> None:
    """The second request shares 48 tokens with the first (12 blocks): it starts its chunks
    after the cached prefix, and gives the tokens of an engine that never cached anything."""
    path = str(tiny_checkpoint("qwen3"))
    base = random_prompts([48], seed=2)[0]
    first, second = base + [7, 8, 9], base + [10, 11, 12, 13, 14]
    cold = LLM(path, block_size=4, max_model_length=96, enable_prefix_caching=False,
               enable_chunked_prefill=False).generate([first, second], GREEDY, use_tqdm=False)
    llm = LLM(path, block_size=4, max_model_length=96, max_num_batched_tokens=10,
              async_scheduling=True)
    a = llm.generate([first], GREEDY, use_tqdm=False)[0]
    b = llm.generate([second], GREEDY, use_tqdm=False)[0]
    assert a["token_ids"] == cold[0]["token_ids"] and b["token_ids"] == cold[1]["token_ids"]
    assert b["num_cached_tokens"] == 48


def test_blocks_of_a_prompt_still_in_prefill_are_shared_only_once_written() -> None:
    """Two equal long prompts in one call: the second is admitted while the first is part-way
    through its chunks, so it can hit only the blocks the first's chunks already wrote."""
    path = str(tiny_checkpoint("llama"))
    prompt = random_prompts([40], seed=3)[0]
    alone = LLM(path, block_size=4, max_model_length=96, enable_chunked_prefill=False,
                enable_prefix_caching=False).generate([prompt], GREEDY, use_tqdm=False)
    llm = LLM(path, block_size=4, max_model_length=96, max_num_batched_tokens=16)
    outs = llm.generate([prompt, prompt], GREEDY, use_tqdm=False)
    assert [o["token_ids"] for o in outs] == [alone[0]["token_ids"]] * 2
    assert 0 < outs[1]["num_cached_tokens"] < 40


def test_preemption_under_kv_pressure() -> None:
    path = tiny_checkpoint("qwen3")
    prompts = random_prompts([30, 22, 35, 5], seed=4)
    llm = LLM(str(path), block_size=4, num_kvcache_blocks=14, max_model_length=64,
              max_num_batched_tokens=8, max_num_sequences=4)
    preempted = []
    original = llm.scheduler.preempt
    llm.scheduler.preempt = lambda seq: preempted.append(seq.seq_id) or original(seq)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert preempted, "the tiny KV pool was meant to force a preemption"
    hf = load_hf_reference(path)
    for prompt, out in zip(prompts, outputs):
        assert out["token_ids"] == hf_greedy(hf, prompt, GREEDY.max_tokens)
    bm = llm.scheduler.block_manager
    assert len(bm.free_block_ids) == len(bm.blocks)


def test_seeded_sampling_does_not_depend_on_the_chunks() -> None:
    """A seeded request draws from its generator only when it samples, so how its prompt was
    cut into chunks does not change its tokens."""
    path = str(tiny_checkpoint("qwen3"))
    prompts = random_prompts([33, 6], seed=5)
    params = SamplingParams(temperature=0.8, max_tokens=8, seed=123, ignore_eos=True)
    whole = LLM(path, block_size=4, max_model_length=64, enable_chunked_prefill=False)
    chunked = LLM(path, block_size=4, max_model_length=64, max_num_batched_tokens=7)
    assert ([o["token_ids"] for o in chunked.generate(prompts, params, use_tqdm=False)]
            == [o["token_ids"] for o in whole.generate(prompts, params, use_tqdm=False)])


def test_a_prompt_longer_than_the_budget_is_accepted_only_when_chunking() -> None:
    path = str(tiny_checkpoint("llama"))
    prompt = random_prompts([30], seed=6)[0]
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        LLM(path, block_size=4, max_model_length=64, max_num_batched_tokens=16,
            enable_chunked_prefill=False).generate([prompt], GREEDY, use_tqdm=False)
    out = LLM(path, block_size=4, max_model_length=64, max_num_batched_tokens=16).generate(
        [prompt], GREEDY, use_tqdm=False)[0]
    assert len(out["token_ids"]) == GREEDY.max_tokens


def test_max_model_length_defaults_to_the_checkpoint_capped_by_the_cache(
        caplog: pytest.LogCaptureFixture) -> None:
    """None takes max_position_embeddings (256 in the tiny config); a cache of 40 blocks of 4
    holds 160 tokens, so one line says it is lowered to that. A length the caller chose is
    kept (add_request refuses a sequence that can never fit instead)."""
    path = str(tiny_checkpoint("qwen3"))
    assert LLM(path, block_size=4, num_kvcache_blocks=100).max_model_length == 256
    with caplog.at_level("INFO", logger="myvllm"):
        llm = LLM(path, block_size=4, num_kvcache_blocks=40)
    assert llm.max_model_length == llm.config.max_model_length == 160
    assert "max_model_length 256 -> 160" in caplog.text
    assert LLM(path, block_size=4, num_kvcache_blocks=40, max_model_length=200
               ).max_model_length == 200
    prompt = random_prompts([150], seed=7)[0]
    # The lowered length is the one requests are checked against, as the server checks it.
    with pytest.raises(ValueError, match="max_tokens=30: allowed: at most 10 beside a "
                                         "prompt of 150 tokens"):
        llm.generate([prompt], SamplingParams(max_tokens=30), use_tqdm=False)
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=10,
                                                ignore_eos=True), use_tqdm=False)[0]
    assert len(out["token_ids"]) == 10


@contextlib.contextmanager
def run_fails_at_call(llm: LLM, n: int) -> Iterator[None]:
    """Inside the block, the runner's n-th run() call (from 1) raises KeyboardInterrupt
    before it computes anything: a step that fails before any of its K/V is written."""
    run, calls = llm.model_runner.run, [0]

    def failing_run(seqs, is_prefill):  # noqa: ANN001, ANN202
        calls[0] += 1
        if calls[0] == n:
            raise KeyboardInterrupt
        return run(seqs, is_prefill)

    llm.model_runner.run = failing_run  # type: ignore[method-assign]
    try:
        yield
    finally:
        llm.model_runner.run = run  # type: ignore[method-assign]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_failed_step_leaves_no_unwritten_block_findable(async_scheduling: bool) -> None:
    """A step that raises before it runs (Ctrl-C, out of memory) had registered the blocks
    its chunks were to write. They must not serve later prefix hits: the engine unregisters
    them and sends the step's sequences back to be recomputed, and every later answer equals
    an engine's that never failed."""
    path = str(tiny_checkpoint("qwen3"))
    prompt = random_prompts([30], seed=8)[0]
    cold = LLM(path, block_size=4, max_model_length=96, enable_prefix_caching=False,
               enable_chunked_prefill=False).generate([prompt], GREEDY, use_tqdm=False)
    llm = LLM(path, block_size=4, max_model_length=96, max_num_batched_tokens=10,
              async_scheduling=async_scheduling)
    # The second chunk (tokens 10..19) never runs.
    with run_fails_at_call(llm, 2), pytest.raises(KeyboardInterrupt):
        llm.generate([prompt], GREEDY, use_tqdm=False)
    again = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert again["num_cached_tokens"] == 8  # the first chunk's two full blocks, no more
    assert again["token_ids"] == cold[0]["token_ids"]

    # Driven by step(): the failed step's sequences are recomputed, and all finish right.
    other = random_prompts([22], seed=9)[0]
    cold_other = LLM(path, block_size=4, max_model_length=96, enable_prefix_caching=False,
                     enable_chunked_prefill=False).generate([other], GREEDY, use_tqdm=False)
    ids = [llm.add_request(p, GREEDY) for p in (prompt, other)]
    outputs = {}
    with run_fails_at_call(llm, 2):
        while not llm.is_finished():
            try:
                finished, _ = llm.step()
            except KeyboardInterrupt:
                continue
            outputs.update({out["seq_id"]: out["token_ids"] for out in finished})
    assert [outputs[i] for i in ids] == [cold[0]["token_ids"], cold_other[0]["token_ids"]]
    assert used_block_ids(llm.scheduler.block_manager) == set()


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("failing_call", [1, 3])
def test_a_failed_step_leaves_no_unwritten_block_findable_prefill_first(
        failing_call: int, async_scheduling: bool) -> None:
    """The same without chunked prefill. A prefill registers all its prompt's full blocks when
    it is admitted (call 1); a decode step registers the block its token completes (call 3
    writes position 31, the last of block 7 with blocks of 4). After either fails, a prompt
    that extends the generated text hits only what was written: blocks 0-6 (28 tokens) or,
    after a failed prefill, nothing. With async scheduling the failed step's token may still be
    pending (its block not yet registered) while the step before it is in flight."""
    path = str(tiny_checkpoint("qwen3"))
    kw: dict = dict(block_size=4, max_model_length=96, enable_chunked_prefill=False,
                    async_scheduling=async_scheduling)
    prompt = random_prompts([30], seed=8)[0]
    first = LLM(path, enable_prefix_caching=False, **kw).generate(
        [prompt], GREEDY, use_tqdm=False)[0]["token_ids"]
    longer = prompt + first[:3]  # 33 tokens: block 7 is tokens 28-31
    cold = LLM(path, enable_prefix_caching=False, **kw).generate(
        [longer], GREEDY, use_tqdm=False)[0]["token_ids"]
    llm = LLM(path, **kw)
    with run_fails_at_call(llm, failing_call), pytest.raises(KeyboardInterrupt):
        llm.generate([prompt], GREEDY, use_tqdm=False)
    assert used_block_ids(llm.scheduler.block_manager) == set()
    again = llm.generate([longer], GREEDY, use_tqdm=False)[0]
    assert again["num_cached_tokens"] == (0 if failing_call == 1 else 28)
    assert again["token_ids"] == cold


def test_generate_steps_are_not_capped_for_streams_but_step_driven_ones_are() -> None:
    """generate() returns its outputs together at the end: its prompts may take the whole
    budget beside its decoding sequences. Requests added one by one (add_request, the
    server) stream: beside their decode rows prompt chunks keep to
    max_prefill_tokens_while_decoding. Greedy tokens are the same either way."""
    path = str(tiny_checkpoint("qwen3"))
    prompts = random_prompts([5, 40, 40], seed=8)
    kw = dict(block_size=4, max_model_length=96, max_num_batched_tokens=32,
              max_prefill_tokens_while_decoding=4)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

    def recording(llm: LLM) -> list[tuple[int, int]]:
        """(decode rows, prompt tokens) of every step the scheduler plans."""
        steps: list[tuple[int, int]] = []
        schedule = llm.scheduler.schedule

        def spy():  # noqa: ANN202
            batch, is_prefill = schedule()
            rows = [s for s in batch if s.num_new_tokens == 1 and s.num_computed_tokens == len(s)]
            steps.append((len(rows), sum(s.num_new_tokens for s in batch) - len(rows)))
            return batch, is_prefill

        llm.scheduler.schedule = spy  # type: ignore[method-assign]
        return steps

    llm = LLM(path, **kw)
    batch_steps = recording(llm)
    batch_tokens = [out["token_ids"] for out in llm.generate(prompts, params, use_tqdm=False)]
    assert max(tokens for rows, tokens in batch_steps if rows) > 4  # beside decode rows
    llm = LLM(path, **kw)
    streamed_steps = recording(llm)
    streamed, _ = budget_steps(llm, prompts, params)
    assert list(streamed.values()) == batch_tokens
    assert max(tokens for rows, tokens in streamed_steps if rows) <= 4
