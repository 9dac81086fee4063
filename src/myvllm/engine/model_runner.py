"""Step 4: the ModelRunner turns a scheduled batch into tensors, runs the model, samples.

One ModelRunner lives in every tensor-parallel rank. Rank 0 (inside the LLMEngine) also
samples; ranks 1..N-1 run in worker processes and only compute their shard of every layer
(see engine/tp_workers.py for how they receive their commands).

What happens to one step:

    scheduler.schedule() -> (seqs, is_prefill)
    ModelRunner.run(seqs, is_prefill)
        prepare_prefill                     host lists -> pinned tensors -> device (non_blocking)
        prepare_decode                      host lists -> DecodeBuffers (fixed, two copies)
        with forward_context(...):          layers read cu_seqlens, slot_mapping, block_tables
            prefill: model, LM head         eager
            decode:  decode_forward         eager, or replay of a captured CUDA graph; on one
                                            GPU it includes the LM head and the sampling kernels
        prepare_sample + Sampler            rank 0: prefill, and decode batches with top-k,
                                            top-p or seeds (or under TP)
    -> one new token id per sequence, in the sampled-token pool, copied back as SampledTokens

The paged KV cache is one tensor per K and V, shaped
(num_layers, num_blocks, block_size, num_kv_heads_per_rank, head_dim); every Attention
module gets a view of its layer. A token's slot is block_id * block_size + offset:

    block_table of a sequence = [7, 2, 9], block_size 4, 10 tokens
    token:   0  1  2  3 | 4  5  6  7 | 8  9
    slot:   28 29 30 31 | 8  9 10 11 |36 37
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from myvllm.config import Config
from myvllm.engine.decode_buffers import DecodeBuffers, DecodeViews, SampledTokens
from myvllm.engine.sequence import Sequence
from myvllm.layers.attention import Attention
from myvllm.layers.sampler import Sampler
from myvllm.models import get_model_class
from myvllm.models.config import get_head_dim
from myvllm.utils.context import forward_context
from myvllm.utils.distributed import get_tp_size
from myvllm.utils.hf_config import load_hf_config
from myvllm.utils.loader import load_model

logger = logging.getLogger("myvllm")

# Used when the KV cache is sized on a CPU: there is no "GPU memory" to take a fraction of,
# so we cap the cache at this many bytes (and at what max_num_sequences full-length
# sequences could ever need).
CPU_KV_CACHE_BYTES = 2 << 30


def resolve_device(config: Config) -> torch.device:
    if config.device == "cpu":
        return torch.device("cpu")
    if config.device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("Config.device='cuda' but torch sees no CUDA device.")
        return torch.device("cuda")
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_dtype(config: Config, device: torch.device) -> torch.dtype:
    if config.dtype == "auto":
        # bf16 is what the checkpoints are trained in; on a CPU fp32 is both faster and exact.
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, config.dtype)


def cuda_graph_batch_sizes(max_num_sequences: int) -> list[int]:
    """[1, 2, 4, 8] + range(16, max+1, 16), capped at max_num_sequences (SPEC D1)."""
    sizes = [bs for bs in (1, 2, 4, 8) if bs <= max_num_sequences]
    sizes += list(range(16, max_num_sequences + 1, 16))
    if max_num_sequences not in sizes:
        sizes.append(max_num_sequences)  # so every batch up to the maximum has a graph
    return sizes


@dataclass
class StepInputs:
    """What prepare_prefill / prepare_decode hand to the forward pass."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    context: dict[str, object]
    decode: DecodeViews | None = None  # a decode step's views of the DecodeBuffers


__all__ = ["ModelRunner", "SampledTokens", "StepInputs"]


class ModelRunner:
    def __init__(self, config: Config, rank: int, model_path: str,
                 hf_config: Any | None = None) -> None:
        self._init_batching(config, rank)
        # Rank 0 gets the config the engine already parsed (a GGUF parse takes seconds).
        self.hf_config = hf_config if hf_config is not None else load_hf_config(model_path)
        model_class = get_model_class(getattr(self.hf_config, "architectures", None) or [])
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                self.model = model_class(self.hf_config)
        finally:
            torch.set_default_dtype(default_dtype)
        load_model(self.model, model_path)
        self.model.eval()
        self.sampler = Sampler()
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        # Per-request seeded generators (rank 0 samples, so only rank 0 fills this).
        self.generators: dict[int, torch.Generator] = {}

    @classmethod
    def without_model(cls, config: Config) -> ModelRunner:
        """A runner that prepares batches (prepare_prefill, prepare_decode) but has no model:
        for the examples that show what those build. Rank 0."""
        runner = cls.__new__(cls)
        runner._init_batching(config, rank=0)
        return runner

    def _init_batching(self, config: Config, rank: int) -> None:
        """Device, dtype and everything batch preparation and CUDA graphs need."""
        self.config = config
        self.rank = rank
        self.block_size = config.block_size
        self.device = resolve_device(config)
        if self.device.type == "cuda":
            self.device = torch.device("cuda", rank)
            torch.cuda.set_device(self.device)
        self.dtype = resolve_dtype(config, self.device)
        # CUDA graphs only exist on a GPU; on a CPU the eager path is the only path.
        self.enforce_eager = config.enforce_eager or self.device.type != "cuda"
        self.pin_memory = self.device.type == "cuda"
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.graph_hidden: dict[int, torch.Tensor] = {}  # each graph's output (static)
        # Each sequence's row in the last step's sampled tokens (the DecodeBuffers pool): a
        # decode step feeds a pending token (Sequence.add_pending_token) from there.
        self.last_sampled_rows: dict[int, int] = {}
        # Pad decode batches to graph shapes on a GPU (see decode_batch_size); a CPU has no
        # graphs and gains nothing from padding (tests switch it on to exercise the padding).
        self.pad_decode = self.device.type == "cuda"
        self.decode_sizes = cuda_graph_batch_sizes(config.max_num_sequences)
        self.max_blocks_per_seq = -(-config.max_model_length // self.block_size)
        # A decode step's inputs and sampled tokens live in fixed buffers: no allocation per
        # step, and a CUDA graph reads them in place (engine/decode_buffers.py).
        self.decode_buffers = DecodeBuffers(config.max_num_sequences, self.max_blocks_per_seq,
                                            self.device, self.pin_memory)
        # With one GPU a decode graph runs the whole step: model, LM head and the sampling
        # kernel. With tensor parallelism the LM head gathers the logits to rank 0 over NCCL,
        # and that gather stays outside the graph.
        self.sample_in_graph = get_tp_size() == 1

    # ------------------------------------------------------------------ start-up
    def initialize_cache(self) -> int:
        """Warm up, size and allocate the KV cache, capture graphs; returns the block count.

        Collective under tensor parallelism: every rank must call it (engine/tp_workers.py).
        """
        start = time.perf_counter()
        if self.device.type == "cuda":  # on a CPU there is no peak to measure
            self.warmup_model()
        num_blocks = self.allocate_kv_cache()
        if self.device.type == "cuda":
            self.warmup_cached_prefix_prefill()
        if self.rank == 0:
            gib = num_blocks * self.kv_cache_block_bytes() / 2**30
            logger.info(f"KV cache: {num_blocks} blocks of {self.block_size} tokens "
                        f"({gib:.2f} GiB per rank), sized in {time.perf_counter() - start:.1f} s")
        if not self.enforce_eager:
            start = time.perf_counter()
            self.capture_cudagraph()
            if self.rank == 0:
                logger.info(f"captured {len(self.graphs)} decode CUDA graphs (batch sizes "
                            f"{sorted(self.graphs)}) in {time.perf_counter() - start:.1f} s")
        return num_blocks

    @torch.inference_mode()
    def warmup_model(self) -> None:
        """Run the largest step the scheduler may send, so the peak memory is measured.

        That is a prefill of max_num_batched_tokens tokens (whole max_model_length sequences
        plus a remainder), then the sampler on max_num_sequences rows of logits with top-p
        (its sort makes several vocabulary-sized copies). A small prefill and the sampling
        kernel follow, so Triton compiles their variants now. One name, max_num_batched_tokens,
        bounds both the scheduler's prefill batches and this warm-up (the original read a
        misspelled second key here).
        """
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        config = self.config
        max_len = config.max_model_length
        budget = min(config.max_num_batched_tokens, max_len * config.max_num_sequences)
        lengths = [max_len] * (budget // max_len)
        if budget % max_len:
            lengths.append(budget % max_len)
        seqs = [Sequence([0] * n, self.block_size) for n in lengths]
        # No KV cache exists yet: prefill attends over the fresh K/V and writes nothing.
        self.run_prefill_without_cache(seqs)
        # Triton compiles one variant of a kernel per "specialisation" of its arguments (an
        # int divisible by 16 or not, equal to 1, ...), ~2 s for the prefill kernel on the
        # H200 machine. A small one-sequence prefill meets specialisations the large one
        # does not (on the H200 it compiled one more variant): better here than mid-request.
        self.run_prefill_without_cache([Sequence([0] * 17, self.block_size)])
        rows = config.max_num_sequences
        # In the model's dtype, as the LM head returns them (the sampler's float() copy of
        # bf16 logits is part of the peak).
        logits = torch.zeros(rows, self.hf_config.vocab_size, device=self.device,
                             dtype=self.dtype)
        ones = torch.ones(rows, device=self.device)
        self.sampler(logits, ones, top_ps=ones * 0.9, all_greedy=False)
        self.sampler(logits, ones, all_greedy=False)  # the sampling kernels, compiled now
        del logits, ones
        torch.cuda.synchronize()
        # Give the freed activations back, or they would count twice when the KV cache is
        # sized: once as memory in use, once as the peak to leave room for.
        torch.cuda.empty_cache()

    @torch.inference_mode()
    def warmup_cached_prefix_prefill(self) -> None:
        """Compile the prefill kernel's variant that reads a cached prefix through the block
        tables (~2 s), here rather than in the first request with a prefix-cache hit.

        A made-up sequence whose first block counts as cached writes K/V into blocks 0-2;
        no hash points at them, so the BlockManager hands them out as fresh blocks later.
        """
        seq = Sequence([0] * (2 * self.block_size + 1), self.block_size)
        if self.num_kvcache_blocks < seq.num_blocks:
            return  # a cache too small to matter; the first hit compiles it
        seq.block_table = list(range(seq.num_blocks))
        seq.num_cached_tokens = self.block_size
        step = self.prepare_prefill([seq])
        with forward_context(**step.context):
            self.model.compute_logits(self.model(step.input_ids, step.positions))

    def run_prefill_without_cache(self, seqs: list[Sequence]) -> None:
        step = self.prepare_prefill(seqs)
        with forward_context(**step.context):
            hidden = self.model(step.input_ids, step.positions)
            self.model.compute_logits(hidden)

    def kv_cache_block_shape(self) -> tuple[int, int, int]:
        """(block_size, KV heads of this rank, head_dim): one block of one layer's K (or V)."""
        num_kv_heads = self.hf_config.num_key_value_heads // get_tp_size()
        return self.block_size, num_kv_heads, get_head_dim(self.hf_config)

    def kv_cache_block_bytes(self) -> int:
        """Bytes one block takes over all layers, K and V."""
        block_size, num_kv_heads, head_dim = self.kv_cache_block_shape()
        per_token = 2 * self.hf_config.num_hidden_layers * num_kv_heads * head_dim
        return block_size * per_token * self.dtype.itemsize

    def allocate_kv_cache(self) -> int:
        config = self.config
        block_bytes = self.kv_cache_block_bytes()
        if config.num_kvcache_blocks > 0:
            num_blocks = config.num_kvcache_blocks
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free
            stats = torch.cuda.memory_stats(self.device)
            # What the warm-up needed beyond the weights is what every step may need again.
            activation_peak = stats["allocated_bytes.all.peak"] - stats["allocated_bytes.all.current"]
            budget = int(total * config.gpu_memory_utilization) - used - activation_peak
            num_blocks = budget // block_bytes
        else:
            num_blocks = min(config.max_num_sequences * self.max_blocks_per_seq,
                             CPU_KV_CACHE_BYTES // block_bytes)
        if get_tp_size() > 1:
            # Every rank must agree on the block count, or the block tables of rank 0 would
            # point past the end of another rank's cache: take the minimum.
            count = torch.tensor([num_blocks], dtype=torch.int64, device=self.device)
            torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MIN)
            num_blocks = int(count.item())
        if num_blocks <= 0:
            raise RuntimeError(
                f"No memory left for the KV cache ({block_bytes} bytes per block of "
                f"{self.block_size} tokens). Lower max_num_batched_tokens or max_model_length, "
                "or raise gpu_memory_utilization."
            )
        shape = (len(self.attention_layers), num_blocks, *self.kv_cache_block_shape())
        self.k_cache = torch.empty(shape, dtype=self.dtype, device=self.device)
        self.v_cache = torch.empty(shape, dtype=self.dtype, device=self.device)
        for layer_id, attention in enumerate(self.attention_layers):
            attention.k_cache = self.k_cache[layer_id]
            attention.v_cache = self.v_cache[layer_id]
        self.num_kvcache_blocks = num_blocks
        return num_blocks

    # ------------------------------------------------------------------ host -> device
    def to_device(self, values: list[int] | list[float], dtype: torch.dtype) -> torch.Tensor:
        """Host list -> (pinned) CPU tensor -> device, without making the host wait."""
        tensor = torch.tensor(values, dtype=dtype, pin_memory=self.pin_memory)
        return tensor.to(self.device, non_blocking=True)

    def prepare_block_tables(self, seqs: list[Sequence]) -> torch.Tensor:
        """Block tables padded with -1 to a rectangle (the kernels never read past the context).

        For a prefill with a cached prefix; decode steps fill theirs in DecodeBuffers.
        """
        width = max(len(seq.block_table) for seq in seqs)
        tables = np.full((len(seqs), width), -1, dtype=np.int32)
        for row, seq in enumerate(seqs):
            tables[row, : len(seq.block_table)] = seq.block_table
        return torch.from_numpy(tables).to(self.device)

    def prepare_prefill(self, seqs: list[Sequence]) -> StepInputs:
        """Flatten the uncached part of every prompt into one batch.

        Two sequences, the first with 4 cached tokens (one block of 4), the second cold:

            seq A: [a0 a1 a2 a3 | a4 a5 a6]   num_cached_tokens = 4
            seq B: [b0 b1 b2]

            input_ids    = [a4 a5 a6 b0 b1 b2]      only what must be computed
            positions    = [ 4  5  6  0  1  2]      RoPE starts at num_cached_tokens
            cu_seqlens_q = [0, 3, 6]                query tokens per sequence
            cu_seqlens_k = [0, 7, 10]               context tokens per sequence (cached + new)
            slot_mapping = one slot per entry of input_ids (the cached ones are already there)

        When any cu_seqlens_k entry exceeds its cu_seqlens_q entry, a prefix is cached and
        the prefill kernel reads K/V through block_tables instead of the fresh tensors.
        """
        input_ids: list[int] = []
        positions: list[int] = []
        cu_seqlens_q, cu_seqlens_k = [0], [0]
        max_seqlen_q = max_seqlen_k = 0
        slot_mapping: list[int] = []
        for seq in seqs:
            num_cached = seq.num_cached_tokens
            seqlen = len(seq)
            input_ids.extend(seq.token_ids[num_cached:])
            positions.extend(range(num_cached, seqlen))
            cu_seqlens_q.append(cu_seqlens_q[-1] + seqlen - num_cached)
            cu_seqlens_k.append(cu_seqlens_k[-1] + seqlen)
            max_seqlen_q = max(max_seqlen_q, seqlen - num_cached)
            max_seqlen_k = max(max_seqlen_k, seqlen)
            if not seq.block_table:  # warm-up: no cache to write to
                continue
            for i in range(seq.num_cached_blocks, seq.num_blocks):
                start = seq.block_table[i] * self.block_size
                count = self.block_size if i != seq.num_blocks - 1 else seq.last_block_num_tokens
                slot_mapping.extend(range(start, start + count))
        prefix_cached = cu_seqlens_k[-1] > cu_seqlens_q[-1]
        context = dict(
            is_prefill=True,
            cu_seqlens_q=self.to_device(cu_seqlens_q, torch.int32),
            cu_seqlens_k=self.to_device(cu_seqlens_k, torch.int32),
            max_seqlen_q=max_seqlen_q,  # host ints: no cu_seqlens.cpu() sync (D6)
            max_seqlen_k=max_seqlen_k,
            slot_mapping=self.to_device(slot_mapping, torch.int32),
            block_tables=self.prepare_block_tables(seqs) if prefix_cached else None,
        )
        return StepInputs(self.to_device(input_ids, torch.int64),
                          self.to_device(positions, torch.int64), context)

    def decode_batch_size(self, num_seqs: int) -> int:
        """The padded batch size a decode step runs at.

        On a GPU, decode always runs at one of the CUDA-graph sizes and with block tables as
        wide as max_model_length, graphs or not. The kernels then see the same shapes in
        both modes, pick the same tiles and split-K chunks, and cuBLAS the same algorithms,
        so enforce_eager=True and CUDA graphs give bit-identical tokens (D1). Padding rows
        use slot -1 (store nothing) and context length 0 (attend to nothing).
        """
        if not self.pad_decode:
            return num_seqs
        return next((bs for bs in self.decode_sizes if bs >= num_seqs), num_seqs)

    def prepare_decode(self, seqs: list[Sequence]) -> StepInputs:
        """One new token per sequence; its K/V goes to the slot after the last one used.

        The values go to the fixed DecodeBuffers (two host-to-device copies, no allocation).
        A sequence whose last token is still pending (overlapped scheduling) reads it from
        the sampled-token pool on the device, without a round trip to the host.
        """
        bs = self.decode_batch_size(len(seqs))
        padding = bs - len(seqs)
        pool_size = self.decode_buffers.max_bs
        token_index = []  # see DecodeBuffers: where each row's input id is read from
        for row, seq in enumerate(seqs):
            if seq.num_pending_tokens == 0:
                token_index.append(pool_size + row)  # the host id below
            else:
                assert seq.seq_id in self.last_sampled_rows, "a pending token but no step"
                token_index.append(self.last_sampled_rows[seq.seq_id])
        token_index += [pool_size + row for row in range(len(seqs), bs)]
        input_ids = [seq.last_token if seq.num_pending_tokens == 0 else 0 for seq in seqs]
        input_ids += [0] * padding
        positions = [len(seq) - 1 for seq in seqs] + [0] * padding
        context_lens = [len(seq) for seq in seqs] + [0] * padding
        slot_mapping = [seq.block_table[-1] * self.block_size + seq.last_block_num_tokens - 1
                        for seq in seqs] + [-1] * padding
        # Only rank 0 samples (a worker's copy of a Sequence carries no sampling_params).
        temperatures = [seq.sampling_params.temperature if self.rank == 0 else 0.0
                        for seq in seqs] + [0.0] * padding
        width = (self.max_blocks_per_seq if self.pad_decode
                 else max(len(seq.block_table) for seq in seqs))
        views = self.decode_buffers.copy_in(
            bs, width, [input_ids, positions, token_index], [slot_mapping, context_lens],
            temperatures, [seq.block_table for seq in seqs])
        return self.decode_step_inputs(views)

    @staticmethod
    def decode_step_inputs(views: DecodeViews) -> StepInputs:
        context = dict(is_prefill=False, slot_mapping=views.slot_mapping,
                       context_lens=views.context_lens, block_tables=views.block_tables)
        return StepInputs(views.input_ids, views.positions, context, views)

    def prepare_sample(self, seqs: list[Sequence]) -> dict[str, object]:
        """Sampling settings as device tensors, plus host-side hints for the fast paths.

        The host knows whether every row is greedy or uses no top-k/top-p; telling the
        sampler saves it a device sync (all-greedy is one argmax) and the sort of top-k/p.
        """
        params = [seq.sampling_params for seq in seqs]
        generators: list[torch.Generator | None] | None = None
        if any(p.seed is not None for p in params):
            generators = [self.generator_for(seq) for seq in seqs]
        all_greedy = all(p.temperature == 0 for p in params)
        use_top_k = any(p.top_k > 0 for p in params)
        use_top_p = any(p.top_p < 1.0 for p in params)
        return dict(
            temperatures=self.to_device([p.temperature for p in params], torch.float32),
            top_ks=self.to_device([p.top_k for p in params], torch.int64) if use_top_k else None,
            top_ps=self.to_device([p.top_p for p in params], torch.float32) if use_top_p else None,
            generators=generators,
            all_greedy=all_greedy,
        )

    def generator_for(self, seq: Sequence) -> torch.Generator | None:
        seed = seq.sampling_params.seed
        if seed is None:
            return None
        if seq.seq_id not in self.generators:
            self.generators[seq.seq_id] = torch.Generator(self.device).manual_seed(seed)
        return self.generators[seq.seq_id]

    def release_generators(self, seq_ids: list[int]) -> None:
        for seq_id in seq_ids:
            self.generators.pop(seq_id, None)

    # ------------------------------------------------------------------ forward
    def decode_forward(self, step: StepInputs, sample: bool, all_greedy: bool = False
                       ) -> torch.Tensor:
        """One decode step on the DecodeBuffers: what a decode CUDA graph captures.

        The model's hidden states for all (padded) rows are returned. With `sample`, the LM
        head and the sampler (temperature only: on a GPU two Triton kernels; greedy rows take
        the argmax) also run, and the tokens go to the sampled-token pool. A graph is
        captured with all_greedy=False, so it serves greedy and sampled batches alike.
        """
        hidden = self.model(step.input_ids, step.positions)
        if sample:
            views = step.decode
            assert views is not None
            logits = self.model.compute_logits(hidden)
            views.sampled.copy_(self.sampler(logits, views.temperatures, all_greedy=all_greedy))
        return hidden

    @staticmethod
    def needs_full_sampler(seqs: list[Sequence]) -> bool:
        """top-k, top-p and per-request seeds need the PyTorch sampler (layers/sampler.py)."""
        return any(seq.sampling_params.top_k > 0 or seq.sampling_params.top_p < 1.0
                   or seq.sampling_params.seed is not None for seq in seqs)

    @torch.inference_mode()
    def run(self, seqs: list[Sequence], is_prefill: bool) -> SampledTokens | None:
        """Queue one step that computes a token for every sequence.

        Rank 0 returns the tokens as SampledTokens (call .token_ids() to wait for them),
        other ranks None. Nothing here waits for the device.

            prefill   model -> LM head (last token of each sequence) -> Sampler
            decode    one GPU, temperature-only sampling: the whole step is one graph
                      replay (decode_forward); otherwise the model (a graph replay), then
                      the LM head and the Sampler outside it
        """
        num_seqs = len(seqs)
        logits = None
        if is_prefill:
            step = self.prepare_prefill(seqs)
            with forward_context(**step.context):
                logits = self.model.compute_logits(self.model(step.input_ids, step.positions))
        else:
            step = self.prepare_decode(seqs)
            full_sampler = not self.sample_in_graph or self.needs_full_sampler(seqs)
            with forward_context(**step.context):
                bs = step.input_ids.size(0)
                if self.enforce_eager or bs not in self.graphs:
                    sample = not full_sampler
                    all_greedy = sample and all(seq.sampling_params.temperature == 0
                                                for seq in seqs)
                    hidden = self.decode_forward(step, sample, all_greedy)
                else:
                    hidden = self.replay_cudagraph(step, bs)
                if full_sampler:  # on every rank: with TP the LM head is collective
                    # All bs rows, as in decode_forward, so both paths compute the same.
                    logits = self.model.compute_logits(hidden)
        if self.rank != 0:
            return None
        pool = self.decode_buffers.sampled
        if logits is not None:
            # No .float() here: greedy argmax is exact in bf16; the sampler casts when it samples.
            pool[:num_seqs].copy_(self.sampler(logits[:num_seqs], **self.prepare_sample(seqs)))
        self.last_sampled_rows = {seq.seq_id: row for row, seq in enumerate(seqs)}
        return self.decode_buffers.read_back(num_seqs)

    # ------------------------------------------------------------------ CUDA graphs
    @torch.inference_mode()
    def capture_cudagraph(self) -> None:
        """Capture one decode graph per batch size, largest first, sharing one memory pool.

        Why only decode: a decode step has a fixed shape per batch size (one token per
        sequence), so a graph captured once can be replayed with new values; prefill shapes
        change with every batch. Decode is also where launch overhead dominates: at batch 1
        the GPU work per layer is tiny and hundreds of kernel launches would take longer
        than the math.

        Every graph reads its inputs from, and writes its tokens to, the DecodeBuffers: the
        views for (bs, max_blocks_per_seq) are the same memory at every step.
        """
        pool = None
        for bs in reversed(self.decode_sizes):
            views = self.decode_buffers.views(bs, self.max_blocks_per_seq)
            # Captured on padding rows: slot -1 (store nothing), context 0 (attend to nothing).
            views.slot_mapping.fill_(-1)
            views.context_lens.zero_()
            views.block_tables.fill_(-1)
            views.temperatures.zero_()
            views.input_ids.zero_()
            views.positions.zero_()
            step = self.decode_step_inputs(views)
            graph = torch.cuda.CUDAGraph()
            with forward_context(**step.context):
                # Warm-up outside the graph (autotuning, lazy init), then capture.
                self.decode_forward(step, sample=self.sample_in_graph)
                with torch.cuda.graph(graph, pool):
                    self.graph_hidden[bs] = self.decode_forward(step, sample=self.sample_in_graph)
            if pool is None:
                pool = graph.pool()
            self.graphs[bs] = graph
            torch.cuda.synchronize()

    def release_cuda_graphs(self) -> None:
        """Drop the captured graphs (decode falls back to eager).

        Called before the process group is destroyed: a graph that captured NCCL
        collectives keeps the communicator in use, and destroying the group then hangs
        (pytorch issue 115388; seen with tensor_parallel_size 2 on two H200s).
        """
        if self.graphs:
            torch.cuda.synchronize(self.device)
            self.graphs.clear()
            self.graph_hidden.clear()

    def replay_cudagraph(self, step: StepInputs, batch_size: int) -> torch.Tensor:
        """Replay the graph of this (padded) batch size; returns the hidden states of all
        batch_size rows.

        There is nothing to copy first: prepare_decode wrote the step into the very buffers
        the graph was captured on, padding rows included (slot -1, so store_kvcache writes
        nothing for them: stale values would overwrite a live sequence's K/V; context
        length 0).
        """
        assert step.decode is not None and step.decode.input_ids.size(0) == batch_size
        self.graphs[batch_size].replay()
        return self.graph_hidden[batch_size]
