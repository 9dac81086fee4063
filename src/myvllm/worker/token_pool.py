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
import torch.distributed as dist

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

    def return_tokens(self, seqs: list[Sequence], tokens: torch.Tensor | None,
                      logprobs: StepLogprobs | None, rank: int, broadcast: bool
                      ) -> SampledTokens | None:
        """ModelRunner.return_tokens through the pool: the step's tokens (None where a decode
        graph sampled into the pool) into its rows, to every rank's pool with `broadcast`
        (tensor parallelism with async scheduling); rank 0 reads them back, other ranks
        return None."""
        num_seqs = len(seqs)
        if tokens is not None:
            self.tokens[:num_seqs].copy_(tokens)
        if broadcast:  # every rank's pool gets this step's tokens (no wait)
            self.share(num_seqs)
        if rank != 0:
            return None
        return self.read_back(seqs, logprobs)

    def share(self, num_seqs: int) -> None:
        """Tensor parallelism: every rank reads pending tokens from its own pool, and only
        rank 0 samples. Collective: rank 0's rows to every rank, queued on the stream after
        its sampler and before the next step's reads."""
        dist.broadcast(self.tokens[:num_seqs], src=0)

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
