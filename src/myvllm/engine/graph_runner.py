"""Step 4c: CUDA graphs of the decode step, captured once per batch size and replayed.

Why only decode: a decode step has a fixed shape per batch size (one token per sequence),
so a graph captured once can be replayed with new values; prefill shapes change with every
batch. Decode is also where launch overhead dominates: at batch 1 the GPU work per layer is
tiny, and launching each kernel from Python would take longer than the math.

Every graph reads its inputs from, and writes its sampled tokens to, the DecodeBuffers: the
views for (batch size, max_blocks_per_seq) are the same memory at every step, so a replay
needs no copy first. A batch is padded up to the smallest captured size that fits
(InputBuilder.decode_batch_size); padding rows have slot -1 (store nothing: stale values
would overwrite a live sequence's K/V) and context length 0 (attend to nothing).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from myvllm.engine.batch import StepInputs
from myvllm.engine.decode_buffers import DecodeBuffers
from myvllm.engine.input_builder import decode_step_inputs
from myvllm.utils.context import forward_context

# What a graph captures: one decode step on the buffers, returning the hidden states.
DecodeForward = Callable[[StepInputs], torch.Tensor]


class GraphRunner:
    def __init__(self) -> None:
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.graph_hidden: dict[int, torch.Tensor] = {}  # each graph's output (static)

    def __contains__(self, batch_size: int) -> bool:
        return batch_size in self.graphs

    @torch.inference_mode()
    def capture(self, decode_forward: DecodeForward, buffers: DecodeBuffers,
                batch_sizes: list[int], width: int) -> None:
        """Capture one graph per batch size, largest first, sharing one memory pool (the
        smaller graphs fit in what the largest one allocated)."""
        pool = None
        for bs in sorted(batch_sizes, reverse=True):
            views = buffers.views(bs, width)
            # Captured on padding rows: slot -1 (store nothing), context 0 (attend to nothing).
            views.slot_mapping.fill_(-1)
            views.context_lens.zero_()
            views.block_tables.fill_(-1)
            views.temperatures.zero_()
            views.input_ids.zero_()
            views.positions.zero_()
            step = decode_step_inputs(views)
            graph = torch.cuda.CUDAGraph()
            with forward_context(step.context):
                # Warm-up outside the graph (autotuning, lazy init), then capture.
                decode_forward(step)
                with torch.cuda.graph(graph, pool):
                    self.graph_hidden[bs] = decode_forward(step)
            if pool is None:
                pool = graph.pool()
            self.graphs[bs] = graph
            torch.cuda.synchronize()

    def replay(self, step: StepInputs) -> torch.Tensor:
        """Replay the graph of this step's (padded) batch size; returns the hidden states of
        all its rows. prepare_decode wrote the step into the very buffers the graph reads."""
        batch_size = step.input_ids.size(0)
        assert step.decode is not None and batch_size in self.graphs
        self.graphs[batch_size].replay()
        return self.graph_hidden[batch_size]

    def release(self, device: torch.device) -> None:
        """Drop the captured graphs (decode falls back to eager).

        Called before the process group is destroyed: a graph that captured NCCL
        collectives keeps the communicator in use, and destroying the group then hangs
        (pytorch issue 115388; seen with tensor_parallel_size 2 on two H200s).
        """
        if self.graphs:
            torch.cuda.synchronize(device)
            self.graphs.clear()
            self.graph_hidden.clear()
