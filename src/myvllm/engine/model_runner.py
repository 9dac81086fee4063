"""Step 4: the ModelRunner runs one step of the model: a batch in, one token per sequence out.

One ModelRunner lives in every tensor-parallel rank. Rank 0 (the Executor's, beside the
EngineCore) also samples; ranks 1..N-1 run in worker processes (engine/tp_workers.py) and only
compute their shard of every layer. One step, run(seqs, is_prefill):

    prefill   InputBuilder.prepare_prefill (prompt chunks, whole prompts, and the decode rows
              beside them in one varlen batch), the model and the LM head, the Sampler
    decode    InputBuilder.prepare_decode, then decode_forward; on one GPU with
              temperature-only sampling it includes the LM head and the sampling kernels
    both      the rows' sampling controls (engine/sampling_controls.py), logprobs
              (engine/logprobs.py) and speculative verification (engine/spec_decode/), each
              one call; the tokens land in the sampled-token pool (engine/token_pool.py) and
              are copied back as SampledTokens

On a GPU both kinds of step are padded onto fixed buffers (engine/padded_steps.py) and
replayed from a CUDA graph where one fits (engine/cuda_graphs.py): the only place graphs
appear here is run_graph_or_eager. Under tensor parallelism with async scheduling, rank 0
broadcasts the pool's rows at the end of each step, so every rank reads a pending token from
its own pool.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

from myvllm.config import Config, stop_token_ids
from myvllm.engine import warmup
from myvllm.engine.batch import StepInputs
from myvllm.engine.cuda_graphs import GraphCache, GraphKey
from myvllm.engine.input_builder import InputBuilder
from myvllm.engine.kv_cache import KVCacheLayout, allocate_kv_cache, count_blocks
from myvllm.engine.logprobs import (LogprobRows, PromptSpan, StepLogprobs, prompt_logprobs,
                                    prompt_spans, sampled_logprobs)
from myvllm.engine.sampling import needs_full_sampler, prepare_sample
from myvllm.engine.sampling_controls import prepare_logits_processing
from myvllm.engine.sequence import Sequence
from myvllm.engine.spec_decode.draft_proposer import make_draft_proposer
from myvllm.engine.spec_decode.verification import (VerificationRows, VerifiedTokens,
                                                    greedy_fast_path_applies, greedy_verify,
                                                    has_proposals, verification_decode_step,
                                                    verifies_as_decode, verify)
from myvllm.engine.token_pool import SampledTokens
from myvllm.kernels import set_batch_invariant
from myvllm.layers.attention import Attention
from myvllm.layers.logits_processors import process_logits
from myvllm.layers.sampler import Sampler
from myvllm.models import get_model_class
from myvllm.models.config import get_head_dim
from myvllm.utils.context import forward_context
from myvllm.utils.device import resolve_device, resolve_dtype, resolve_kv_cache_dtype
from myvllm.utils.distributed import get_tp_size, local_device_index
from myvllm.utils.dummy_weights import initialize_dummy_weights
from myvllm.utils.hf_config import load_hf_config
from myvllm.utils.loader import load_model

logger = logging.getLogger("myvllm")

__all__ = ["ModelRunner", "SampledTokens", "StepInputs"]


class CausalLM(Protocol):
    """What the runner needs of a model class (models/decoder.py's CausalLM, which every model
    file builds on)."""

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor: ...

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None: ...


class ModelRunner:
    def __init__(self, config: Config, rank: int, model_path: str,
                 hf_config: Any | None = None) -> None:
        self.config = config
        self.rank = rank
        self.device = resolve_device(config)
        if self.device.type == "cuda":
            self.device = torch.device("cuda", local_device_index(rank))  # LOCAL_RANK: torchrun
            torch.cuda.set_device(self.device)
        self.dtype = resolve_dtype(config, self.device)
        # Before the model is built and warmed up: the kernels read it at every call, and the
        # CUDA graphs captured below bake in what they read (kernels/batch_invariant.py).
        set_batch_invariant(config.batch_invariant)
        # CUDA graphs only exist on a GPU; on a CPU the eager path is the only path.
        self.enforce_eager = config.enforce_eager or self.device.type != "cuda"
        self.inputs = InputBuilder(config, self.device, rank)
        self.graphs = GraphCache()
        # With one GPU a decode graph runs the whole step: model, LM head and the sampling
        # kernels. With tensor parallelism the LM head gathers the logits to rank 0 over
        # NCCL, and that gather stays outside the graph.
        self.sample_in_graph = get_tp_size() == 1
        # Async scheduling under tensor parallelism: the ranks that do not sample read the
        # next step's pending tokens from their own pool, so rank 0 shares its (see run).
        self.broadcast_sampled = get_tp_size() > 1 and bool(config.async_scheduling)

        # Rank 0 gets the config the engine already parsed (a GGUF parse takes seconds).
        self.hf_config = hf_config if hf_config is not None else load_hf_config(model_path)
        model_class = get_model_class(getattr(self.hf_config, "architectures", None) or [])
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                module = model_class(self.hf_config)
        finally:
            torch.set_default_dtype(default_dtype)
        if config.load_format == "dummy":
            initialize_dummy_weights(module)  # no checkpoint read: config.json is enough
        else:
            load_model(module, model_path)
        module.eval()
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
        # speculative_method "draft": the draft model and its own KV cache (rank 0 only).
        self.draft = make_draft_proposer(config, self.hf_config)

    # ------------------------------------------------------------------ start-up
    def initialize_cache(self) -> int:
        """Warm up, size and allocate the KV cache, capture graphs; returns the block count.
        What only a GPU does here is in engine/warmup.py.

        Collective under tensor parallelism: every rank must call it (engine/tp_workers.py).
        """
        start = time.perf_counter()
        on_gpu = self.device.type == "cuda"  # a CPU has no peak to measure, no graphs
        if on_gpu:
            warmup.warmup_model(self)
        # A draft model's cache has a block for each of the target's (same block tables).
        draft_bytes = self.draft.block_bytes if self.draft is not None else 0
        num_blocks = count_blocks(self.config, self.kv_layout, self.device,
                                  self.inputs.max_blocks_per_seq, draft_bytes)
        self.k_cache, self.v_cache = allocate_kv_cache(self.attention_layers, self.kv_layout,
                                                       num_blocks, self.device)
        if self.draft is not None:
            self.draft.allocate_cache(num_blocks)
        self.num_kvcache_blocks = num_blocks
        if on_gpu:
            warmup.warmup_cached_prefix_prefill(self)
        if self.rank == 0:
            gib = num_blocks * self.kv_layout.block_bytes / 2**30
            logger.info(f"KV cache: {num_blocks} blocks of {self.config.block_size} tokens "
                        f"({gib:.2f} GiB per rank), sized in {time.perf_counter() - start:.1f} s")
        if on_gpu:
            warmup.pad_and_capture(self)
        return num_blocks

    # ------------------------------------------------------------------ one step
    def forward_prefill(self, seqs: list[Sequence], spans: list[PromptSpan] | None = None,
                        verification: VerificationRows | None = None
                        ) -> tuple[torch.Tensor | None, LogprobRows | None]:
        """The model and LM head over each sequence's scheduled chunk (num_new_tokens tokens
        up to num_computed_tokens) -> (logits of each sequence's last token computed, the
        logprobs of the prompt rows in spans) on rank 0; (None, None) on other ranks.
        With verification rows (speculative decoding), the logits of verification.logit_rows
        instead: every position of a row that verifies proposals."""
        step = self.inputs.prepare_prefill(seqs)
        key = ("prefill", step.input_ids.size(0)) if step.context.q_tiles is not None else None
        with forward_context(step.context):
            hidden = self.run_graph_or_eager(key, step, self.body_forward)
            # The LM head reads the last row of each sequence (context.cu_seqlens_q): padding
            # rows are never read.
            logits = self.model.compute_logits(hidden) if verification is None else None
        if verification is not None:
            # Outside the context the LM head keeps every row it is given (collective under
            # tensor parallelism: every rank has the same rows).
            rows = self.inputs.fresh.tensor(verification.logit_rows, torch.int64)
            logits = self.model.compute_logits(hidden[rows])
        if not spans:
            return logits, None
        # Outside the context, where the LM head keeps every row it is given.
        return logits, prompt_logprobs(seqs, spans, hidden, self.model.compute_logits,
                                       self.inputs.fresh.tensor, self.config.max_num_sequences)

    def run_graph_or_eager(self, key: GraphKey | None, step: StepInputs,
                           forward: Callable[[StepInputs], torch.Tensor]) -> torch.Tensor:
        """The seam between the model and CUDA graphs: replay the graph captured for this
        padded step (staged into the buffers it reads), or run forward(step)."""
        if key is not None and key in self.graphs:
            return self.graphs.replay(key)
        return forward(step)

    def body_forward(self, step: StepInputs) -> torch.Tensor:
        """The model's body on one step: hidden states of all its rows (what a chunk graph
        captures)."""
        return self.model(step.input_ids, step.positions)

    def decode_forward(self, step: StepInputs, sample: bool, all_greedy: bool = False
                       ) -> torch.Tensor:
        """One decode step: what a decode CUDA graph captures.

        Returns the model's hidden states for all (padded) rows. With `sample`, the LM head
        and the sampler (temperature only: on a GPU two Triton kernels; greedy rows take the
        argmax) also run, and the tokens go to the sampled-token pool. A graph is captured
        with all_greedy=False, so it serves greedy and sampled batches alike.
        """
        hidden = self.model(step.input_ids, step.positions)
        if sample:
            assert step.sampled is not None and step.temperatures is not None
            logits = self.model.compute_logits(hidden)
            step.sampled.copy_(self.sampler(logits, step.temperatures, all_greedy=all_greedy))
        return hidden

    def graph_forward(self, step: StepInputs) -> torch.Tensor:
        """What each decode graph captures (with or without sampling, see sample_in_graph)."""
        return self.decode_forward(step, sample=self.sample_in_graph)

    @torch.inference_mode()
    def run(self, seqs: list[Sequence], is_prefill: bool) -> SampledTokens | None:
        """Queue one step that computes a token for every sequence.

        Rank 0 returns the tokens as SampledTokens (call .token_ids() to wait for them),
        other ranks None. Nothing here waits for the device (NCCL collectives are queued on
        the stream like any kernel).
        """
        # Again at every step: a second engine in this process may have set its own mode.
        set_batch_invariant(self.config.batch_invariant)
        spans = prompt_spans(seqs) if is_prefill else []
        # Before the forward: it reads pending tokens from the pool, which a decode graph
        # overwrites with its own samples (engine/sampling_controls.py).
        processing = (prepare_logits_processing(seqs, self.inputs.fresh.tensor,
                                                self.inputs.pool.tokens, self.eos_token_ids)
                      if self.rank == 0 else None)
        prompt_rows = None
        # Speculative decoding: rows that verify proposals (scheduled as a prefill-path step;
        # with no prompt chunk beside them they run as decode rows).
        verification = VerificationRows(seqs) if has_proposals(seqs) else None
        # A draft model fills the rows' proposal slots first (and gives their q).
        draft_probs = self.draft.propose(seqs) if self.draft is not None else None
        verified = None
        as_decode_rows = (verification is not None and not spans
                          and verifies_as_decode(seqs, self.config.max_num_sequences))
        if is_prefill and not as_decode_rows:
            logits, prompt_rows = self.forward_prefill(seqs, spans, verification)
        else:
            logits = self.run_decode(seqs, verifies=as_decode_rows)
        num_seqs = len(seqs)
        pool = self.inputs.pool
        if (verification is not None and logits is not None and not self.broadcast_sampled
                and greedy_fast_path_applies(seqs, processing, bool(spans))):
            return greedy_verify(seqs, verification, logits, pool, self.inputs.fresh.tensor)
        step_logprobs = None
        if self.rank == 0 and logits is not None:  # else the step sampled into the pool itself
            args = prepare_sample(seqs, self.inputs.fresh.tensor, self.device,
                                  self.hf_config.vocab_size)
            if verification is not None:
                verified = VerifiedTokens(*verify(seqs, verification, logits, args,
                                                  self.inputs.fresh.tensor, draft_probs))
                # The one-token-per-row sampling below reads each row's last logits.
                logits = logits[self.inputs.fresh.tensor(verification.last_rows, torch.int64)]
            # No .float() here: greedy argmax is exact in bf16; the sampler casts when it samples.
            # Logprobs (below) stay those of the raw logits, as vLLM's default.
            to_sample = (logits[:num_seqs] if processing is None
                         else process_logits(logits[:num_seqs], processing))
            tokens = self.sampler(to_sample, args.temperatures, args.top_ks, args.top_ps,
                                  args.generators, all_greedy=args.all_greedy,
                                  min_ps=args.min_ps, token_bitmask=args.token_bitmask)
            pool.tokens[:num_seqs].copy_(tokens)
            asked, sampled_rows = sampled_logprobs(seqs, logits[:num_seqs], tokens,
                                                   self.inputs.fresh.tensor)
            if sampled_rows is not None or prompt_rows is not None:
                step_logprobs = StepLogprobs(asked, sampled_rows, spans, prompt_rows)
        if self.broadcast_sampled:
            # Every rank's pool now holds this step's tokens, in the rows where the next
            # step's pending tokens are read (Sequence.sampled_row, shipped with the
            # sequences); the host does not wait for it.
            pool.share(num_seqs)
        if self.rank != 0:
            return None
        sampled = pool.read_back(seqs, step_logprobs)
        sampled.verified = verified
        return sampled

    def run_decode(self, seqs: list[Sequence], verifies: bool = False) -> torch.Tensor | None:
        """A decode step; returns the logits when the Sampler must still run on them, None
        when the step sampled into the pool itself (one GPU, temperature-only rows).
        verifies: the step's verification rows run as decode rows (verify reads the logits
        of every row)."""
        step = (verification_decode_step(self.inputs, seqs) if verifies
                else self.inputs.prepare_decode(seqs))
        full_sampler = verifies or not self.sample_in_graph or needs_full_sampler(seqs)
        sample = not full_sampler
        all_greedy = sample and all(seq.sampling_params.temperature == 0 for seq in seqs)
        # A graph samples with all_greedy=False (see decode_forward): the same tokens.
        key = ("decode", step.input_ids.size(0)) if self.inputs.padded is not None else None
        with forward_context(step.context):
            hidden = self.run_graph_or_eager(
                key, step, lambda step: self.decode_forward(step, sample, all_greedy))
            if not full_sampler:
                return None
            # On every rank: with tensor parallelism the LM head is collective. All rows, as
            # in decode_forward, so that both paths compute the same.
            return self.model.compute_logits(hidden)

    def release_cuda_graphs(self) -> None:
        """Drop the captured graphs before the process group goes (GraphCache.release)."""
        self.graphs.release(self.device)
