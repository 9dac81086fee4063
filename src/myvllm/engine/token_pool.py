"""The sampled-token pool: where each step's tokens land on the device, row by row, and the
one place where a pending token (async scheduling: sampled, not yet on the host; the guide's
Step 6) is read, in row Sequence.sampled_row. A step's input ids are gathered on the device:

    source      = [ pool (size rows) | host ids (n) ]
    token_index = [ size + i   where the host knows token i (its id is in host ids)
                    row        where token i is pending: that row of the pool ]
    input_ids   = source[token_index]

A first reading on a CPU can skip this file: without async scheduling (a CPU's default) no
token is pending, so last_token is seq.last_token and input_ids the host ids on the device;
read_back keeps a copy of the step's rows, and SampledTokens.token_ids() is their list.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist

from myvllm.engine.logprobs import StepLogprobs
from myvllm.engine.sequence import Sequence
from myvllm.engine.static_buffers import PinnedSlots

if TYPE_CHECKING:
    from myvllm.engine.spec_decode.verification import VerifiedTokens
    from myvllm.engine.staging import FreshTensors


class TokenPool:
    def __init__(self, tokens: torch.Tensor) -> None:
        """tokens: the pool, [max_num_sequences] int64 on the device (on a GPU a field of
        the StaticBuffers, so that decode graphs write into it)."""
        self.tokens = tokens
        self.size = tokens.numel()
        # The way back on a GPU: two pinned host slots that alternate.
        self.host_slots = (PinnedSlots({torch.int64: self.size}, on_gpu=True)
                           if tokens.device.type == "cuda" else None)

    # ------------------------------------------------------------------ into the next step
    @staticmethod
    def last_token(seq: Sequence, at: int, pending: list[tuple[int, int]]) -> int:
        """The host id of seq's last token, an input at position `at` of the step; if it is
        still pending, 0 as a placeholder and (at, its row of the pool) added to pending."""
        if not seq.num_pending_tokens:
            return seq.last_token
        assert seq.sampled_row is not None, "a pending token but no step"
        pending.append((at, seq.sampled_row))
        return 0

    def input_ids(self, fresh: FreshTensors, host_ids: list[int],
                  pending: list[tuple[int, int]]) -> torch.Tensor:
        """A step's input ids on the device (host_ids, built with last_token), the pending
        ones read from the pool. (PaddedSteps stages its host ids right after the pool and
        gathers from there.)"""
        ids = fresh.tensor(host_ids, torch.int64)
        if not pending:
            return ids
        index = fresh.tensor(self.token_index(len(host_ids), pending), torch.int64)
        return self.gather(torch.cat([self.tokens, ids]), index)

    def token_index(self, num_ids: int, pending: list[tuple[int, int]]) -> np.ndarray:
        """Where each of a step's num_ids input ids is read from in [pool | host ids]."""
        index = np.arange(self.size, self.size + num_ids, dtype=np.int64)
        for at, row in pending:
            index[at] = row
        return index

    def gather(self, source: torch.Tensor, token_index: torch.Tensor,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids = source[token_index], source being [pool | host ids] on the device."""
        return torch.index_select(source, 0, token_index, out=out)

    # ------------------------------------------------------------------ after the step
    def share(self, num_seqs: int) -> None:
        """Collective (tensor parallelism): rank 0's rows to every rank, queued on the stream
        after its sampler and before the next step's reads."""
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
        host, slot, turn = self.host_slots.copy_to_host(self.tokens[:num_seqs])
        return SampledTokens(host, host_logprobs, self.host_slots, slot, turn)


class SampledTokens:
    """The token ids of one step, on their way to the host: token_ids() waits for the copy.
    On a GPU the host memory is one of two slots that alternate, so they must be read before
    two more steps run (later raises; the engine reads each step right after the next)."""

    def __init__(self, host: torch.Tensor, logprobs: StepLogprobs | None = None,
                 slots: PinnedSlots | None = None, slot: int = 0, turn: int = 0) -> None:
        self.host = host
        self._slots, self._slot, self._turn = slots, slot, turn
        self.logprobs = logprobs  # valid once token_ids() has waited
        # Speculative decoding: the rows' verified tokens (their token_ids() entry is unused).
        self.verified: VerifiedTokens | None = None

    def token_ids(self) -> list[int]:
        if self._slots is not None:
            self._slots.wait_for(self._slot, self._turn)
        return self.host.tolist()
