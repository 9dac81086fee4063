"""What the features that act on a step's logits, or read them, do in a step with features
(worker/feature_step.py): one object per step, so that the step makes one call per stage
(the guide's Features, "Logprobs: where they are computed").

    before the forward  LogitsFeatures(seqs, ...): the prompt rows that asked for logprobs
                        (on every rank: the LM head over them is collective) and, on rank 0,
                        the sampling controls' tensors (sample/sampling_controls.py; pending
                        tokens are read from the pool before a decode graph overwrites it)
    forward_prefill     add_prompt_logprobs: the LM head over those prompt rows
    after the LM head   sample: the controls rewrite the logits (process_logits), a
                        grammar's bitmask masks them (structured_output/manager.py,
                        layers/token_bitmask.py), the Sampler draws, and the rows that
                        asked get their logprobs (of the raw logits, as vLLM's default;
                        sample/logprobs.py)
    read_back           .logprobs, copied to the host with the step's tokens

A step whose rows ask for none of these builds nothing: the Sampler alone runs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from myvllm.engine.batch import SamplingArgs
from myvllm.sample.logprobs import (LogprobRows, StepLogprobs, prompt_logprobs, prompt_spans,
                                    sampled_logprobs)
from myvllm.sample.sampling_controls import ToDevice, prepare_logits_processing
from myvllm.engine.sequence import Sequence
from myvllm.structured_output.manager import fill_token_bitmask
from myvllm.layers.logits_processors import process_logits
from myvllm.layers.sampler import Sampler
from myvllm.layers.token_bitmask import apply_token_bitmask


class LogitsFeatures:
    def __init__(self, seqs: list[Sequence], samples: list[bool], is_prefill: bool, rank: int,
                 to_device: ToDevice, pool_tokens: torch.Tensor, eos_token_ids: frozenset[int]
                 ) -> None:
        """samples: which rows sample in this step (their chunk reaches their last token);
        pool_tokens: the sampled-token pool (penalties read pending tokens from it);
        eos_token_ids: banned until a row reaches its min_tokens."""
        self.seqs = seqs
        self.samples = samples
        self.to_device = to_device
        self.prompt_spans = prompt_spans(seqs) if is_prefill else []
        # Rank 0 alone samples (a worker's copy of a Sequence carries no sampling_params).
        self.processing = (prepare_logits_processing(seqs, to_device, pool_tokens,
                                                     eos_token_ids) if rank == 0 else None)
        self.prompt_rows: LogprobRows | None = None
        self.logprobs: StepLogprobs | None = None  # set by sample, for read_back

    def add_prompt_logprobs(self, hidden: torch.Tensor,
                            compute_logits: Callable[[torch.Tensor], torch.Tensor | None],
                            max_rows: int) -> None:
        """The prompt rows' logprobs from a prefill's hidden states (call it outside the
        forward context, where the LM head keeps every row it is given)."""
        if self.prompt_spans:
            self.prompt_rows = prompt_logprobs(self.seqs, self.prompt_spans, hidden,
                                               compute_logits, self.to_device, max_rows)

    def sample(self, sampler: Sampler, logits: torch.Tensor, args: SamplingArgs,
               vocab_size: int) -> torch.Tensor:
        """logits: one row per sequence -> the sampled tokens (rank 0)."""
        seqs = self.seqs
        # No .float() here: greedy argmax is exact in bf16; the sampler casts when it samples.
        to_sample = logits if self.processing is None else process_logits(logits,
                                                                           self.processing)
        if any(seq.extras is not None and seq.extras.grammar_matcher is not None for seq in seqs):
            # Structured outputs: only the tokens whose bit is set may be picked.
            bitmask = fill_token_bitmask(seqs, self.samples, vocab_size)
            if bitmask is not None:
                to_sample = apply_token_bitmask(to_sample, bitmask.to(logits.device))
        tokens = sampler(to_sample, args.temperatures, args.top_ks, args.top_ps,
                         args.generators, all_greedy=args.all_greedy, min_ps=args.min_ps)
        asked, sampled_rows = sampled_logprobs(seqs, self.samples, logits, tokens,
                                               self.to_device)
        if sampled_rows is not None or self.prompt_rows is not None:
            self.logprobs = StepLogprobs(asked, sampled_rows, self.prompt_spans,
                                         self.prompt_rows)
        return tokens
