"""Batch-invariant mode: every kernel reduces in an order that does not depend on the batch.

Why: a floating-point sum depends on its order, and the fast kernels pick their order by
shape. cuBLAS chooses an algorithm (and a split over K) by the row count; the decode kernel
splits each context into a number of chunks chosen from the batch size; the prefill kernel
treats a key tile as "full" or "on the diagonal" depending on where its query tile starts,
which moves with a cached prefix or a chunk boundary. So one request's logits change, in
the last bits, with what else shares its batch, and in bf16 a near tie between two tokens
flips: on an H200 a run whose prompts hit the prefix cache agreed with a cold run on 45 of
128 greedy sequences.

With the mode on (Config.batch_invariant, set by the ModelRunner for its process):

    matmuls        one Triton kernel whose sum over K runs in chunks of 512 elements from 0,
                   added in order; a decode batch computes the chunks in parallel (split-K
                   of a fixed chunk size, not a fixed number of splits), a prefill in one
                   program per output tile; the row tile follows the shape, never the order
                   (invariant_matmul_kernel.py); the LM head too
    attention      prefill, chunks and decode rows all run the prefill kernel: key tiles of
                   a fixed size from position 0, every tile through the same (masked) code,
                   one program per query tile (no split-K), whether its keys are cached or new;
                   a decode step puts a KV head's query heads in one 64-row query tile,
                   not a 128-row tile per head (decode_tile_config: the query tile is
                   free, the key tile is not)
    the rest       already one program per row whatever the batch: RMSNorm, q/k norm + RoPE,
                   SiLU-and-mul, the sampling kernels (their vocabulary chunks depend on the
                   vocabulary only), log_softmax

The switch is a process-wide setting, like the step's context (utils/context.py): kernels
read it at call time, so a CUDA graph captured with it on replays the invariant kernels. It is
this module's flag, set by set_batch_invariant (the ModelRunner calls it, from its Config) and
read by the dispatch in kernels/__init__.py as an attribute, so with the mode off nothing of
this file runs in a plain step. kernels re-exports both functions.
"""

from __future__ import annotations

enabled = False  # set_batch_invariant sets it; the dispatch in kernels/__init__.py reads it


def set_batch_invariant(on: bool) -> None:
    """Turn batch-invariant mode on or off for this process; the kernels' dispatch reads it at
    call time."""
    global enabled
    if not isinstance(on, bool):
        raise TypeError(f"set_batch_invariant expects True or False, got {on!r}")
    enabled = on


def is_batch_invariant() -> bool:
    return enabled
