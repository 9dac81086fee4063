"""Async scheduling's pending tokens (the guide's Features, "Async scheduling"): tokens counted
before their value is known. Async scheduling plans step N+1 before step N's tokens reach the
host.

The Sequence's side (Sequence.num_pending_tokens; add_pending_token and drop_pending_tokens
here): each sequence of step N counts one pending token (its K/V slot, its place in a block),
which Scheduler.postprocess fills in (Sequence.append_token takes the oldest pending slot).
What plans by length works unchanged; only what reads token values waits.

The runner's side, the functions here: a pending token is read on the device, from its row
of the sampled-token pool (worker/token_pool.py; that row is Sequence.sampled_row). A step's
input ids are gathered there:

    source      = [ pool (size rows) | host ids (n) ]
    token_index = [ size + i   where the host knows token i (its id is in host ids)
                    row        where token i is pending: that row of the pool ]
    input_ids   = source[token_index]

A first reading on a CPU can skip this file: without async scheduling (a CPU's default) no
token is pending, and the InputBuilder (worker/input_builder.py) calls none of it: a step's
last tokens are seq.last_token, its input ids the host ids on the device.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from myvllm.engine.sequence import Sequence
    from myvllm.worker.staging import FreshTensors
    from myvllm.worker.token_pool import TokenPool


def add_pending_token(seq: Sequence) -> None:
    """Count a token sampled by a step not read back yet (its K/V slot and its place in a
    block); Sequence.append_token fills it in."""
    seq.num_tokens += 1
    seq.num_pending_tokens += 1


def drop_pending_tokens(seq: Sequence) -> None:
    """Forget tokens that will never be read (the sequence finished, or its step was
    abandoned); the next step recomputes from the last known token."""
    if seq.num_pending_tokens:
        seq.num_tokens -= seq.num_pending_tokens
        seq.num_pending_tokens = 0
        # The last known token's K/V came from the abandoned step: compute it again.
        seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens - 1)


def pending_token(seq: Sequence, at: int, pending: list[tuple[int, int]]) -> int:
    """seq's last token is pending, an input at position `at` of the step: 0 as its host id
    (a placeholder) and (at, its row of the pool) added to pending."""
    assert seq.sampled_row is not None, "a pending token but no step"
    pending.append((at, seq.sampled_row))
    return 0


def input_ids(pool: TokenPool, fresh: FreshTensors, host_ids: list[int],
              pending: list[tuple[int, int]]) -> torch.Tensor:
    """A step's input ids on the device (host_ids, with pending_token's placeholders), the
    pending ones read from the pool. (PaddedSteps stages its host ids right after the pool
    and gathers from there.)"""
    ids = fresh.tensor(host_ids, torch.int64)
    index = fresh.tensor(token_index(pool.size, len(host_ids), pending), torch.int64)
    return gather(torch.cat([pool.tokens, ids]), index)


def token_index(pool_size: int, num_ids: int, pending: list[tuple[int, int]]) -> np.ndarray:
    """Where each of a step's num_ids input ids is read from in [pool | host ids]."""
    index = np.arange(pool_size, pool_size + num_ids, dtype=np.int64)
    for at, row in pending:
        index[at] = row
    return index


def gather(source: torch.Tensor, token_index: torch.Tensor,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """input_ids = source[token_index], source being [pool | host ids] on the device."""
    return torch.index_select(source, 0, token_index, out=out)
