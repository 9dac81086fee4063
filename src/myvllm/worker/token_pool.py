"""The sampled-token pool: where each step's tokens land on the device, row by row
(Sequence.sampled_row), and their way back to the host (read_back -> SampledTokens). A token
still pending under async scheduling is read from its row (worker/pending_tokens.py).

Only GPUs (where decode graphs sample into it, and its pinned slots bring the tokens back)
and async scheduling (where the next step reads pending tokens from it) use it: a CPU step
without async scheduling returns the sampler's tokens as they are (ModelRunner.run).
"""

from __future__ import annotations

import functools

import torch

from myvllm.engine.sequence import Sequence
from myvllm.sample.logprobs import StepLogprobs
from myvllm.worker.staging import SampledTokens
from myvllm.worker.static_buffers import PinnedSlots


class TokenPool:
    def __init__(self, tokens: torch.Tensor) -> None:
        """tokens: the pool, [max_num_sequences] int64 on the device (on a GPU a field of
        the StaticBuffers, so that decode graphs write into it)."""
        self.tokens = tokens
        self.size = tokens.numel()
        # The way back on a GPU: two pinned host slots that alternate.
        self.host_slots = (PinnedSlots({torch.int64: self.size}, on_gpu=True)
                           if tokens.device.type == "cuda" else None)

    def read_back(self, seqs: list[Sequence], logprobs: StepLogprobs | None = None
                  ) -> SampledTokens:
        """Queue the copy of this step's tokens (rows 0..len(seqs)-1) and logprobs to the host,
        and note each sequence's row for the next step; returns at once."""
        for row, seq in enumerate(seqs):
            seq.sampled_row = row
        num_seqs = len(seqs)
        # Queued before the event below, which then says that they have arrived too.
        host_logprobs = logprobs.to_host() if logprobs is not None else None
        if self.host_slots is None:  # a CPU: the step has run; keep them past the next one
            return SampledTokens(self.tokens[:num_seqs].clone(), host_logprobs)
        # On a GPU the host slots alternate, so the tokens must be read before two more
        # steps run (later raises; the engine reads each step right after the next).
        host, slot, turn = self.host_slots.copy_to_host(self.tokens[:num_seqs])
        return SampledTokens(host, host_logprobs,
                             functools.partial(self.host_slots.wait_for, slot, turn))
