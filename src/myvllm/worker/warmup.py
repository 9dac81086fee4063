"""What a ModelRunner does at start-up (initialize_cache): the KV cache sized and allocated,
and on a GPU only, warm-ups before it, then padding and graphs.

    warmup_model                    the largest step the scheduler may send, so that the peak
                                    memory is measured before the KV cache is sized, and the
                                    kernels' variants are compiled before the first request
    warmup_cached_prefix_prefill    the prefill variant that reads a cached prefix
    pad_and_capture                 steps padded onto fixed buffers from now on, and their
                                    CUDA graphs captured (worker/padded_steps.py, cuda_graphs.py)

A CPU runs none of those: it has no peak to measure, no Triton compile and no graphs.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Protocol

import torch

from myvllm.config import Config
from myvllm.engine.batch import StepInputs
from myvllm.engine.sequence import Sequence
from myvllm.layers.logits_processors import LogitsProcessing, Penalties, process_logits
from myvllm.layers.attention import Attention
from myvllm.layers.sampler import Sampler
from myvllm.spec_decode.verification import Verifier
from myvllm.worker.cuda_graphs import GraphCache, GraphRunner, decode_forward
from myvllm.worker.input_builder import InputBuilder
from myvllm.worker.kv_cache import KVCacheLayout, allocate_kv_cache, count_blocks
from myvllm.worker.padded_steps import pad_steps

logger = logging.getLogger("myvllm")


class WarmupRunner(GraphRunner, Protocol):
    """A ModelRunner (engine/model_runner.py), as its start-up here sees it."""

    config: Config
    rank: int
    device: torch.device
    dtype: torch.dtype
    hf_config: Any
    enforce_eager: bool
    sample_in_graph: bool
    inputs: InputBuilder
    graphs: GraphCache
    sampler: Sampler
    kv_layout: KVCacheLayout
    attention_layers: list[Attention]
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    num_kvcache_blocks: int
    verifier: Verifier | None

    def forward_prefill(self, seqs: list[Sequence]) -> torch.Tensor | None: ...

    def body_forward(self, step: StepInputs) -> torch.Tensor: ...


def initialize_cache(runner: WarmupRunner) -> int:
    """Warm up (GPU), size and allocate the KV cache, capture graphs (GPU); returns the
    block count."""
    start = time.perf_counter()
    on_gpu = runner.device.type == "cuda"  # a CPU has no peak to measure, no graphs
    # speculative_method "draft": the draft model and its own KV cache (rank 0 only).
    draft = runner.verifier.draft if runner.verifier is not None else None
    if on_gpu:
        if draft is not None:  # first: the target's warm-up measures the peak
            draft.warm_up()
        warmup_model(runner)
    # A draft model's cache has a block for each of the target's (same block tables).
    draft_bytes = draft.block_bytes if draft is not None else 0
    num_blocks = count_blocks(runner.config, runner.kv_layout, runner.device,
                              runner.inputs.max_blocks_per_seq, draft_bytes)
    runner.k_cache, runner.v_cache = allocate_kv_cache(runner.attention_layers,
                                                       runner.kv_layout, num_blocks,
                                                       runner.device)
    if draft is not None:
        draft.allocate_cache(num_blocks)
    runner.num_kvcache_blocks = num_blocks
    if on_gpu:
        warmup_cached_prefix_prefill(runner)
    if runner.rank == 0:
        gib = num_blocks * runner.kv_layout.block_bytes / 2**30
        logger.info(f"KV cache: {num_blocks} blocks of {runner.config.block_size} tokens "
                    f"({gib:.2f} GiB per rank), sized in {time.perf_counter() - start:.1f} s")
    if on_gpu:
        pad_and_capture(runner)
    return num_blocks


def pad_and_capture(runner: WarmupRunner) -> None:
    """GPU: pad steps onto fixed buffers from now on, and capture their CUDA graphs
    (unless enforce_eager: padded in eager mode too, so that both compute the same)."""
    chunk_tiles = None
    if runner.config.enable_chunked_prefill:
        from myvllm.kernels.prefill_attention import prefill_config  # imports triton

        tiles = prefill_config(runner.device, runner.kv_layout.head_dim, runner.dtype)
        chunk_tiles = (tiles.block_m, tiles.block_n)
    padded = pad_steps(runner.inputs, chunk_tiles)
    if runner.enforce_eager:
        return

    def decode_graph_forward(step: StepInputs) -> torch.Tensor:
        """What each decode graph captures (with or without sampling, see sample_in_graph)."""
        return decode_forward(runner, step, sample=runner.sample_in_graph)

    for kind, sizes, inputs, forward in (
            ("decode", padded.decode_sizes, padded.capture_decode_inputs,
             decode_graph_forward),
            ("prefill", padded.chunk_sizes, padded.capture_prefill_inputs,
             runner.body_forward)):
        start = time.perf_counter()
        runner.graphs.capture(kind, sizes, inputs, forward)
        if runner.rank == 0 and sizes:
            logger.info(f"captured {len(sizes)} {kind} CUDA graphs (sizes {sizes}) in "
                        f"{time.perf_counter() - start:.1f} s")


@torch.inference_mode()
def warmup_model(runner: WarmupRunner) -> None:
    """Run the largest step the scheduler may send, so the peak memory is measured.

    That is a prefill of max_num_batched_tokens tokens (whole max_model_length sequences
    plus a remainder), then the sampler on max_num_sequences rows of logits with top-p
    (its sort makes several vocabulary-sized copies). A small prefill and the sampling
    kernels follow, so Triton compiles their variants now. The scheduler's prefill
    batches are bounded by the same max_num_batched_tokens.
    """
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    config = runner.config
    max_len = runner.inputs.max_blocks_per_seq * config.block_size
    budget = min(config.max_num_batched_tokens, max_len * config.max_num_sequences)
    lengths = [max_len] * (budget // max_len)
    if budget % max_len:
        lengths.append(budget % max_len)
    # No KV cache exists yet: prefill attends over the fresh K/V and writes nothing.
    runner.forward_prefill([made_up_prompt(runner.config.block_size, n) for n in lengths])
    # Triton compiles one variant of a kernel per "specialisation" of its arguments (an
    # int divisible by 16 or not, equal to 1, ...), ~2 s for the prefill kernel on the
    # H200 machine. A small one-sequence prefill meets specialisations the large one
    # does not (on the H200 it compiled one more variant): better here than mid-request.
    runner.forward_prefill([made_up_prompt(runner.config.block_size, 17)])
    warmup_sampler(runner)
    torch.cuda.synchronize()
    # Give the freed activations back, or they would count twice when the KV cache is
    # sized: once as memory in use, once as the peak to leave room for.
    torch.cuda.empty_cache()


@torch.inference_mode()
def warmup_sampler(runner: WarmupRunner) -> None:
    """The sampler on max_num_sequences rows of logits, with top-p (its sort makes several
    vocabulary-sized copies), with the sampling controls as well, and without, then on 3
    rows: up to 8 rows the sampling kernels launch with programmatic dependent launch
    (kernels/pdl.py), a variant of their own that Triton compiles now. Part of
    warmup_model, so that its peak counts when the KV cache is sized."""
    rows = runner.config.max_num_sequences
    # In the model's dtype, as the LM head returns them (the sampler's float() copy of
    # bf16 logits is part of the peak).
    logits = torch.zeros(rows, runner.hf_config.vocab_size, device=runner.device,
                         dtype=runner.dtype)
    ones = torch.ones(rows, device=runner.device)
    runner.sampler(logits, ones, top_ps=ones * 0.9, all_greedy=False)
    # Every row penalised, then min-p and top-p: the sampling controls' vocabulary-sized
    # counts, masks and processed copy (layers/logits_processors.py) count in the peak too.
    index = torch.arange(rows, device=runner.device)
    penalties = Penalties(rows=index, presence=ones, frequency=ones, repetition=ones * 1.1,
                          output_rows=index, output_token_ids=index * 0, prompt_rows=index,
                          prompt_token_ids=index * 0)
    processed = process_logits(logits, LogitsProcessing(penalties=penalties))
    runner.sampler(processed, ones, top_ps=ones * 0.9, min_ps=ones * 0.1, all_greedy=False)
    del processed
    runner.sampler(logits, ones, all_greedy=False)  # the sampling kernels, compiled now
    runner.sampler(logits[:3], ones[:3], all_greedy=False)


@torch.inference_mode()
def warmup_cached_prefix_prefill(runner: WarmupRunner) -> None:
    """Compile the prefill kernel's variant that reads a cached prefix through the block
    tables (~2 s), here rather than in the first request with a prefix-cache hit.

    A made-up sequence whose first block counts as cached writes K/V into blocks 0-2;
    no hash points at them, so the BlockManager hands them out as fresh blocks later.
    """
    block_size = runner.config.block_size
    seq = made_up_prompt(runner.config.block_size, 2 * block_size + 1, num_cached=block_size)
    if runner.num_kvcache_blocks < seq.num_blocks:
        return  # a cache too small to matter; the first hit compiles it
    seq.block_table = list(range(seq.num_blocks))
    runner.forward_prefill([seq])


def made_up_prompt(block_size: int, num_tokens: int, num_cached: int = 0) -> Sequence:
    """A warm-up prompt of token 0s, scheduled whole after num_cached cached tokens (no
    block table: nothing is stored unless the caller gives it one)."""
    seq = Sequence([0] * num_tokens, block_size)
    seq.num_cached_tokens = num_cached
    seq.num_computed_tokens = num_tokens
    seq.num_new_tokens = num_tokens - num_cached
    return seq
