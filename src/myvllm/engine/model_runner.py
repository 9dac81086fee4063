"""Step 4: the ModelRunner runs one step of the model: a batch in, one token per sequence out.

One lives in every tensor-parallel rank; rank 0 (beside the EngineCore) also samples. On a
GPU a step is padded and replayed from a CUDA graph where one fits: graphs appear here only
in run_graph_or_eager.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from myvllm.config import Config, stop_token_ids
from myvllm.engine.batch import SamplingArgs, StepInputs
from myvllm.engine.sequence import Sequence
from myvllm.kernels import batch_invariant, set_batch_invariant
from myvllm.sample.logprobs import StepLogprobs
from myvllm.sample.sampling_controls import ToDevice
from myvllm.spec_decode.verification import Verifier
from myvllm.worker import warmup
from myvllm.worker.cuda_graphs import GraphCache, GraphKey, decode_sampling_in_graph
from myvllm.worker.feature_step import run_feature_step
from myvllm.worker.input_builder import InputBuilder
from myvllm.worker.kv_cache import KVCacheLayout
from myvllm.worker.model_loading import CausalLM, build_model
from myvllm.worker.staging import SampledTokens
from myvllm.layers.attention import Attention
from myvllm.layers.sampler import Sampler
from myvllm.models.config import get_head_dim
from myvllm.utils.context import forward_context
from myvllm.utils.device import rank_device, resolve_dtype, resolve_kv_cache_dtype
from myvllm.utils.distributed import get_tp_size
from myvllm.utils.hf_config import load_hf_config


class ModelRunner:
    # The KV cache of every layer, [layers, blocks, ...]: allocated by initialize_cache.
    k_cache: torch.Tensor
    v_cache: torch.Tensor

    def __init__(self, config: Config, rank: int, model_path: str,
                 hf_config: Any | None = None) -> None:
        self.config = config
        self.rank = rank
        self.device = rank_device(config, rank)
        self.dtype = resolve_dtype(config, self.device)
        # Before the model is built: the CUDA graphs captured below bake in what kernels read.
        set_batch_invariant(config.batch_invariant)
        on_gpu = self.device.type == "cuda"
        # CUDA graphs only exist on a GPU; on a CPU the eager path is the only path.
        self.enforce_eager = config.enforce_eager or not on_gpu
        self.inputs = InputBuilder(config, self.device, rank)
        self.graphs = GraphCache()
        # With one GPU a decode step samples inside its forward, so that its graph runs the
        # whole step; with tensor parallelism the LM head's gather to rank 0 (NCCL) stays
        # outside the graph, and a CPU (no graphs) samples after the forward as a prefill does.
        self.sample_in_graph = on_gpu and get_tp_size() == 1
        # Async scheduling under tensor parallelism: every rank reads pending tokens from its
        # own pool, so rank 0 shares its sampled tokens (see sample).
        self.broadcast_sampled = get_tp_size() > 1 and bool(config.async_scheduling)
        # The sampled tokens go through the pool (worker/token_pool.py) on a GPU, whose decode
        # graphs sample into it and whose pinned slots bring them back, and with async
        # scheduling, whose next step reads pending tokens from it. A CPU step without async
        # scheduling returns the sampler's tokens as they are.
        self.tokens_via_pool = on_gpu or bool(config.async_scheduling)

        # Rank 0 gets the config the engine already parsed (a GGUF parse takes seconds).
        self.hf_config = hf_config if hf_config is not None else load_hf_config(model_path)
        module = build_model(config, self.hf_config, model_path, self.device, self.dtype)
        self.model: CausalLM = module  # type: ignore[assignment]  # nn.Module hides its methods
        self.sampler = Sampler()
        self.eos_token_ids = stop_token_ids(config.eos)  # masked until min_tokens (rank 0)
        self.attention_layers = [m for m in module.modules() if isinstance(m, Attention)]
        self.kv_layout = KVCacheLayout(
            num_layers=len(self.attention_layers), block_size=config.block_size,
            num_kv_heads=self.hf_config.num_key_value_heads // get_tp_size(),
            head_dim=get_head_dim(self.hf_config),
            dtype=resolve_kv_cache_dtype(config, self.dtype))
        self.num_kvcache_blocks = 0  # set by initialize_cache
        # Speculative decoding: the steps' rows that verify proposals (spec_decode/), and
        # with speculative_method "draft" the draft model; None when it is off.
        self.verifier = (Verifier(config.max_num_sequences)
                         if config.speculative_method is not None else None)

    # ------------------------------------------------------------------ start-up
    def initialize_cache(self) -> int:
        """Warm up (GPU), size and allocate the KV cache, capture graphs (GPU): returns the
        block count (worker/warmup.py). Collective under tensor parallelism."""
        return warmup.initialize_cache(self)

    # ------------------------------------------------------------------ one step
    def forward_prefill(self, seqs: list[Sequence]) -> torch.Tensor | None:
        """The model and LM head over each sequence's chunk -> on rank 0 the logits of each
        one's last token, else None. (A step with features: worker/feature_step.py.)"""
        step = self.inputs.prepare_prefill(seqs)
        with forward_context(step.context):
            hidden = self.prefill_hidden(step)
            # The LM head reads each sequence's last row (context.cu_seqlens_q), never padding.
            return self.model.compute_logits(hidden)

    def prefill_hidden(self, step: StepInputs) -> torch.Tensor:
        """The model's body over a prefill step (inside its forward context): replayed from
        the chunk graph of its padded size where one was captured (a GPU), else eager."""
        key = ("prefill", step.input_ids.size(0)) if step.context.q_tiles is not None else None
        return self.run_graph_or_eager(key, step, self.body_forward)

    def run_graph_or_eager(self, key: GraphKey | None, step: StepInputs,
                           forward: Callable[[StepInputs], torch.Tensor]) -> torch.Tensor:
        """The seam between the model and CUDA graphs: replay the graph captured for this
        padded step (staged into the buffers it reads), or run forward(step)."""
        if key is not None and key in self.graphs:
            return self.graphs.replay(key)
        return forward(step)

    def body_forward(self, step: StepInputs) -> torch.Tensor:
        """The model's body (what a chunk graph captures)."""
        return self.model(step.input_ids, step.positions)

    @torch.inference_mode()
    def run(self, seqs: list[Sequence], is_prefill: bool) -> SampledTokens | None:
        """Queue one step that computes a token for every sequence; rank 0 returns them as
        SampledTokens, other ranks None. Nothing here waits for the device."""
        if batch_invariant.enabled != self.config.batch_invariant:
            # Another engine in this process set its own mode: this one's again.
            set_batch_invariant(self.config.batch_invariant)
        if any(seq.extras is not None for seq in seqs):  # some row asks for a feature
            return run_feature_step(self, seqs, is_prefill,
                                    [samples_this_step(seq) for seq in seqs])
        logits = (self.forward_prefill(seqs) if is_prefill
                  else self.run_decode(seqs))
        return self.sample(seqs, logits)

    def sample(self, seqs: list[Sequence], logits: torch.Tensor | None) -> SampledTokens | None:
        """A plain step's tokens from its logits (None: the step sampled into the pool
        itself); rank 0 returns them as SampledTokens, other ranks None. A step with
        features samples in worker/feature_step.py."""
        tokens = None
        if self.rank == 0 and logits is not None:
            args = self.sampling_args(seqs)
            tokens = self.sampler(logits[:len(seqs)], args.temperatures, args.top_ks,
                                  args.top_ps, args.generators, all_greedy=args.all_greedy)
        return self.return_tokens(seqs, tokens)

    def sampling_args(self, seqs: list[Sequence]) -> SamplingArgs:
        return prepare_sample(seqs, self.inputs.fresh.tensor, self.device)

    def return_tokens(self, seqs: list[Sequence], tokens: torch.Tensor | None,
                      logprobs: StepLogprobs | None = None) -> SampledTokens | None:
        """The step's sampled tokens (rank 0's; None where a decode graph sampled into the
        pool) on their way back; rank 0 returns them as SampledTokens, other ranks None."""
        if self.tokens_via_pool:  # a GPU, or async scheduling (worker/token_pool.py)
            return self.inputs.pool.return_tokens(seqs, tokens, logprobs, self.rank,
                                                  self.broadcast_sampled)
        if self.rank != 0:
            return None
        # A CPU without async scheduling: nothing reads them on the device.
        assert tokens is not None  # a CPU step samples here (sample_in_graph is False)
        return SampledTokens(tokens, logprobs)

    def run_decode(self, seqs: list[Sequence]) -> torch.Tensor | None:
        """A decode step -> its logits, or None where its decode graph sampled into the
        pool itself (one GPU: worker/cuda_graphs.py)."""
        if self.sample_in_graph:
            return decode_sampling_in_graph(self, seqs)
        return self.decode_logits(self.inputs.prepare_decode(seqs))

    def decode_logits(self, step: StepInputs) -> torch.Tensor | None:
        """The model and LM head over a decode step's rows: replayed from the decode graph of
        its padded size where one was captured (a GPU), else eager."""
        key = ("decode", step.input_ids.size(0)) if self.inputs.padded is not None else None
        with forward_context(step.context):
            hidden = self.run_graph_or_eager(key, step, self.body_forward)
            # On every rank (the LM head is collective); all (padded) rows.
            return self.model.compute_logits(hidden)


def samples_this_step(seq: Sequence) -> bool:
    """The step's chunk reaches the sequence's last token, so the step's token is its next
    (a decode row always does, and a row verifying proposals reaches past it, to the last
    proposal); a chunk that stops short of its prompt's end samples nothing."""
    return seq.num_computed_tokens >= seq.num_tokens


def prepare_sample(seqs: list[Sequence], to_device: ToDevice, device: torch.device
                   ) -> SamplingArgs:
    """Each sequence's SamplingParams as the Sampler's per-row arguments, on the device, plus
    host-side hints for the fast paths (rank 0).

    Seeds and min-p ask for extras (engine/sequence.py): a plain step has neither, and a
    step with features adds them (worker/feature_step.py).
    """
    params = [seq.sampling_params for seq in seqs]
    use_top_k = any(p.top_k > 0 for p in params)
    use_top_p = any(p.top_p < 1.0 for p in params)
    return SamplingArgs(
        temperatures=to_device([p.temperature for p in params], torch.float32),
        top_ks=to_device([p.top_k for p in params], torch.int64) if use_top_k else None,
        top_ps=to_device([p.top_p for p in params], torch.float32) if use_top_p else None,
        generators=None, min_ps=None,
        all_greedy=all(p.temperature == 0 for p in params),
    )
