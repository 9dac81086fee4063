"""Step 6 end to end on the CPU: LLMEngine against HF transformers' generate.

Each test builds the engine on a tiny random checkpoint (tests/helpers_models.py) and
compares greedy tokens with transformers on the same weights, under the conditions where
an engine is easiest to get wrong: preemption in a tiny KV pool, prefix reuse across calls.
"""

from __future__ import annotations

import logging

import pytest
import torch
from helpers_blocks import used_block_ids
from helpers_models import hf_greedy, load_hf_reference, random_prompts, tiny_checkpoint

from myvllm import LLM, Config, SamplingParams
from myvllm.config import ConfigError
from myvllm.worker.padded_steps import pad_steps
from myvllm.engine.model_runner import prepare_sample
from myvllm.worker.warmup import warmup_cached_prefix_prefill




GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.mark.parametrize("kind", ["qwen3", "llama3"])
def test_greedy_batch_with_preemption_matches_transformers(kind: str) -> None:
    path = tiny_checkpoint(kind)
    prompts = random_prompts([5, 11, 17, 3, 9])
    # 5 sequences of up to 17 + 12 tokens need ~30 blocks of 4; 12 blocks force preemption.
    llm = LLM(str(path), block_size=4, num_kvcache_blocks=12, max_num_sequences=4,
              max_model_length=64, max_num_batched_tokens=64)
    preempted: list[int] = []
    original_preempt = llm.scheduler.preempt

    def counting_preempt(seq):
        preempted.append(seq.seq_id)
        original_preempt(seq)

    llm.scheduler.preempt = counting_preempt
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert preempted, "the tiny KV pool was meant to force at least one preemption"

    hf_model = load_hf_reference(path)
    for prompt, out in zip(prompts, outputs):
        assert out["token_ids"] == hf_greedy(hf_model, prompt, GREEDY.max_tokens)
    # All blocks are back in the free list once everything finished.
    manager = llm.scheduler.block_manager
    assert len(manager.free_block_ids) == len(manager.blocks) and not used_block_ids(manager)
    llm.exit()


def test_prefix_reuse_across_generate_calls_matches_cold_engine() -> None:
    path = tiny_checkpoint("qwen3")
    shared = random_prompts([21], seed=1)[0]
    first = shared + [7, 8]
    second = shared + [9, 10, 11]
    llm = LLM(str(path), block_size=4, num_kvcache_blocks=64, max_model_length=64,
              max_num_batched_tokens=128)
    out1 = llm.generate([first], GREEDY, use_tqdm=False)[0]
    assert out1["num_cached_tokens"] == 0
    out2 = llm.generate([second], GREEDY, use_tqdm=False)[0]
    # The first request finished, yet its full blocks (5 blocks = 20 tokens) are still hashed.
    assert out2["num_cached_tokens"] == 20

    cold = LLM(str(path), block_size=4, num_kvcache_blocks=64, max_model_length=64,
               max_num_batched_tokens=128, enable_prefix_caching=False)
    cold_out = cold.generate([second], GREEDY, use_tqdm=False)[0]
    assert cold_out["num_cached_tokens"] == 0
    assert out2["token_ids"] == cold_out["token_ids"]

    # A prompt that is entirely cached still runs its last block through the model.
    again = llm.generate([second], GREEDY, use_tqdm=False)[0]
    assert 0 < again["num_cached_tokens"] < len(second)
    assert again["token_ids"] == cold_out["token_ids"]


def test_strings_text_and_input_order() -> None:
    path = tiny_checkpoint("llama")
    llm = LLM(Config(model=str(path), block_size=8, max_model_length=64,
                     max_num_batched_tokens=128))
    prompts = ["hello there", [72, 105], "a much longer prompt than the others"]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (3, 5, 4)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o["token_ids"]) for o in outputs] == [3, 5, 4]
    hf_model = load_hf_reference(path)
    for prompt, param, out in zip(prompts, params, outputs):
        ids = llm.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        assert out["token_ids"] == hf_greedy(hf_model, ids, param.max_tokens)
        assert out["text"] == llm.tokenizer.decode(out["token_ids"], skip_special_tokens=True)


def test_seeded_sampling_is_reproducible() -> None:
    path = tiny_checkpoint("qwen3")
    llm = LLM(str(path), block_size=8, max_model_length=64, max_num_batched_tokens=128)
    prompt = random_prompts([6])[0]
    params = SamplingParams(temperature=1.0, max_tokens=10, seed=1234, ignore_eos=True)
    alone = llm.generate([prompt], params, use_tqdm=False)[0]["token_ids"]
    # Same seed in a different batch: the per-request generator gives the same tokens.
    others = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)
    batched = llm.generate([random_prompts([4], 5)[0], prompt], [others, params],
                           use_tqdm=False)[1]["token_ids"]
    assert alone == batched


def test_cpu_forces_eager_and_says_so() -> None:
    path = tiny_checkpoint("qwen3")
    records: list[logging.LogRecord] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Collect()
    logging.getLogger("myvllm").addHandler(handler)
    try:
        llm = LLM(str(path), enforce_eager=False, device="cpu", max_model_length=64,
                  max_num_batched_tokens=128)
    finally:
        logging.getLogger("myvllm").removeHandler(handler)
    assert llm.model_runner.enforce_eager and not llm.model_runner.graphs.graphs
    assert any("CUDA graphs are off" in r.getMessage() for r in records)


def test_unknown_engine_keyword_names_the_closest_field() -> None:
    with pytest.raises(ConfigError, match="max_num_sequences"):
        LLM(str(tiny_checkpoint("qwen3")), max_num_seqs=4)


def test_decode_padding_to_graph_sizes_changes_no_token() -> None:
    """On a GPU every decode batch is padded to a CUDA-graph size (slot -1, context 0) and
    tables to full width; here the same padding is switched on on the CPU."""
    path = str(tiny_checkpoint("qwen3"))
    prompts = random_prompts([5, 9, 3])
    kwargs = dict(block_size=4, max_model_length=64, max_num_batched_tokens=128,
                  max_num_sequences=8)
    plain = LLM(path, **kwargs).generate(prompts, GREEDY, use_tqdm=False)
    llm = LLM(path, **kwargs)
    inputs = llm.model_runner.inputs
    pad_steps(inputs, chunk_tiles=None)
    shapes: list[tuple[int, ...]] = []
    original = inputs.prepare_decode

    def recording_prepare_decode(seqs):
        step = original(seqs)
        shapes.append(tuple(step.context.block_tables.shape))
        assert step.context.slot_mapping[len(seqs):].eq(-1).all()
        assert step.context.context_lens[len(seqs):].eq(0).all()
        return step

    inputs.prepare_decode = recording_prepare_decode
    padded = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert (4, 16) in shapes  # 3 sequences padded to the graph size 4, 64 / 4 = 16 blocks wide
    assert [o["token_ids"] for o in padded] == [o["token_ids"] for o in plain]


def test_prepare_reads_nothing_back_from_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """Batch preparation only writes host data to the device. max_seqlen comes from the
    sequence lengths the host knows, never from cu_seqlens.cpu()."""
    llm = LLM(str(tiny_checkpoint("qwen3")), block_size=4, max_model_length=64,
              max_num_batched_tokens=128)
    llm.generate([list(range(1, 13))], GREEDY, use_tqdm=False)  # leaves 3 cached blocks
    for prompt in (list(range(1, 13)) + [40, 41], [50, 51, 52, 53, 54]):
        llm.add_request(prompt, GREEDY)
    seqs, is_prefill = llm.scheduler.schedule()
    assert is_prefill and seqs[0].num_cached_tokens == 12

    def forbidden(*args, **kwargs):
        raise AssertionError("a device-to-host read in batch preparation")

    runner = llm.model_runner
    inputs = runner.inputs
    with monkeypatch.context() as patch:
        for name in ("cpu", "item", "tolist", "numpy", "__bool__", "__int__"):
            patch.setattr(torch.Tensor, name, forbidden)
        prefill = inputs.prepare_prefill(seqs)
    assert prefill.context.max_seqlen_q == 5 and prefill.context.max_seqlen_k == 14
    assert prefill.context.block_tables is not None  # a cached prefix: paged prefill
    llm.scheduler.postprocess(seqs, [7, 7])
    seqs, is_prefill = llm.scheduler.schedule()
    assert not is_prefill
    with monkeypatch.context() as patch:
        for name in ("cpu", "item", "tolist", "numpy", "__bool__", "__int__"):
            patch.setattr(torch.Tensor, name, forbidden)
        inputs.prepare_decode(seqs)
        prepare_sample(seqs, inputs.fresh.tensor, runner.device)
    for seq in seqs:
        llm.scheduler.abort(seq)


def test_a_prefill_reads_the_cache_through_block_tables_only_after_a_hit() -> None:
    """prepare_prefill hands attention block tables exactly when a sequence of the step has
    context in the cache (a prefix hit here; a chunk after the first alike), else the
    contiguous path: fresh K/V only. The tables are the block tables, -1 padded, as wide as
    the longest rounded up to a multiple of 16."""
    from myvllm.engine.scheduler import Scheduler
    from myvllm.engine.sequence import Sequence
    from myvllm.worker.input_builder import InputBuilder

    config = Config(device="cpu", num_kvcache_blocks=64, block_size=1, max_model_length=64,
                    eos=-1, enable_chunked_prefill=False)
    scheduler, inputs = Scheduler(config), InputBuilder(config)
    prompt = list(range(1, 17))  # 16 blocks of one token
    scheduler.add_sequence(Sequence(prompt, 1, SamplingParams(max_tokens=1)))
    seqs, _ = scheduler.schedule()
    assert inputs.prepare_prefill(seqs).context.block_tables is None  # nothing cached yet
    scheduler.postprocess(seqs, [5])  # finished: its 16 blocks stay cached
    hit = Sequence(prompt + [30], 1, SamplingParams(max_tokens=1))
    scheduler.add_sequence(hit)
    seqs, _ = scheduler.schedule()
    tables = inputs.prepare_prefill(seqs).context.block_tables
    assert hit.num_cached_tokens == 16 and tables is not None
    assert tables.shape == (1, 32) and tables[0, :17].tolist() == hit.block_table
    assert tables[0, 17:].eq(-1).all()


def test_a_padded_decode_step_carries_the_temperatures_on_rank_0_only() -> None:
    """A padded decode step (a GPU's: it samples inside its CUDA graph) carries each row's
    temperature, 0 for the padding rows; on a tensor-parallel worker (rank > 0), which
    samples nothing, all 0. An InputBuilder is rank 0's unless told otherwise."""
    from myvllm.engine.sequence import Sequence
    from myvllm.worker.input_builder import InputBuilder

    config = Config(device="cpu", num_kvcache_blocks=16, block_size=4, max_model_length=64,
                    max_num_sequences=4)
    seqs = [Sequence([1, 2, 3], 4, SamplingParams(temperature=t)) for t in (0.5, 0.25, 1.5)]
    for i, s in enumerate(seqs):
        s.block_table = [i]
    for builder, want in ((InputBuilder(config), [0.5, 0.25, 1.5, 0.0]),
                          (InputBuilder(config, rank=1), [0.0] * 4)):
        pad_steps(builder, chunk_tiles=None)
        step = builder.prepare_decode(seqs)
        assert step.temperatures is not None and step.temperatures.tolist() == want


def test_add_request_and_step_give_what_generate_gives() -> None:
    llm = LLM(str(tiny_checkpoint("llama")), block_size=4, max_model_length=64,
              max_num_batched_tokens=128)
    prompts = random_prompts([6, 10, 3], seed=4)
    expected = llm.generate(prompts, GREEDY, use_tqdm=False)
    seq_ids = [llm.add_request(p, GREEDY) for p in prompts]
    outputs: dict[int, dict] = {}
    while not llm.is_finished():
        finished, _ = llm.step()
        outputs.update({out["seq_id"]: out for out in finished})
    assert sorted(outputs) == sorted(seq_ids)
    assert [outputs[i]["token_ids"] for i in seq_ids] == [o["token_ids"] for o in expected]
    # The second round hits the first round's blocks, and nothing is left behind.
    assert [outputs[i]["num_cached_tokens"] for i in seq_ids] == [4, 8, 0]
    assert llm.engine_core.requests == {}
    assert llm.step() == ([], 0)  # an idle engine runs no forward pass


def test_cuda_graph_batch_sizes_cover_every_batch() -> None:
    from myvllm.worker.padded_steps import cuda_graph_batch_sizes

    assert cuda_graph_batch_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert cuda_graph_batch_sizes(5) == [1, 2, 4, 5]
    assert cuda_graph_batch_sizes(40) == [1, 2, 4, 8, 16, 32, 40]


def test_cached_prefix_warmup_writes_only_blocks_nobody_owns_yet() -> None:
    """warmup_cached_prefix_prefill (worker/warmup.py: run at start-up on a GPU, after the KV cache
    exists and before any request, to compile the prefill kernel's cached-prefix variant)
    runs here on the CPU: it writes K/V only into the first blocks, registers no hash, and
    the engine then generates what a fresh engine does."""
    prompts = random_prompts([6, 9], seed=3)
    fresh = LLM(str(tiny_checkpoint("qwen3")), block_size=4, num_kvcache_blocks=16,
                max_model_length=64, max_num_batched_tokens=64)
    expected = fresh.generate(prompts, GREEDY, use_tqdm=False)

    llm = LLM(str(tiny_checkpoint("qwen3")), block_size=4, num_kvcache_blocks=16,
              max_model_length=64, max_num_batched_tokens=64)
    runner = llm.model_runner
    runner.k_cache.zero_()
    runner.v_cache.zero_()
    warmup_cached_prefix_prefill(runner)  # 2 * 4 + 1 tokens: blocks 0, 1, 2
    written = (runner.k_cache != 0) | (runner.v_cache != 0)  # [layers, blocks, ...]
    written_blocks = written.flatten(2).any(dim=-1).any(dim=0).nonzero().flatten().tolist()
    assert written_blocks and set(written_blocks) <= {0, 1, 2}
    assert not llm.scheduler.block_manager.hash_to_block_id
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o["token_ids"] for o in outputs] == [o["token_ids"] for o in expected]
