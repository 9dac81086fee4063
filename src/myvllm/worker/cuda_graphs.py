"""CUDA graphs: each padded step shape captured once, then replayed with new values.

A step launched from Python pays for every kernel launch (~300 for 28 layers) whatever the
GPU has to do; at batch 1 or a short chunk that costs more than the math. A CUDA graph
records the launches once and replays them in one call. It replays fixed shapes on fixed
memory, so the steps it serves are padded onto fixed buffers (worker/padded_steps.py):

    ("decode", batch size)     a decode step, with the LM head and the sampling kernels
                               (one GPU) or without (tensor parallelism)
    ("prefill", padded tokens) a chunked step's model body (embedding to final norm)

All graphs share one memory pool: they run one at a time, and each step's output is read
before the next graph replays.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from myvllm.engine.batch import StepInputs
from myvllm.utils.context import forward_context

GraphKey = tuple[str, int]  # (kind of step, padded size)


class GraphCache:
    def __init__(self) -> None:
        self.graphs: dict[GraphKey, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[GraphKey, torch.Tensor] = {}  # each graph's output (static)
        self.pool: Any = None  # the memory pool handle of the first graph captured

    def __contains__(self, key: GraphKey) -> bool:
        return key in self.graphs

    def sizes(self, kind: str) -> list[int]:
        return sorted(size for k, size in self.graphs if k == kind)

    @torch.inference_mode()
    def capture(self, kind: str, sizes: list[int], inputs: Callable[[int], StepInputs],
                forward: Callable[[StepInputs], torch.Tensor]) -> None:
        """One graph per size, largest first (the smaller ones fit in what it allocated),
        each on inputs(size): padding only, so the capture computes nothing real."""
        for size in sorted(sizes, reverse=True):
            step = inputs(size)
            graph = torch.cuda.CUDAGraph()
            with forward_context(step.context):
                forward(step)  # warm-up outside the graph (Triton compiles, cuBLAS picks)
                with torch.cuda.graph(graph, self.pool):
                    self.outputs[kind, size] = forward(step)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[kind, size] = graph
            torch.cuda.synchronize()
        # A graph's first launch uploads it to the device: 1.1 ms of host time in the first
        # step that replayed a 768-token graph on the H200, mid-serving. Done here instead,
        # on the padding inputs of the smallest size (nothing computed, nothing stored).
        for size in sizes:
            self.graphs[kind, size].replay()
        torch.cuda.synchronize()

    def replay(self, key: GraphKey) -> torch.Tensor:
        """Run the graph on what was staged into its buffers; its output (the hidden states
        of all padded rows: padding rows hold garbage)."""
        self.graphs[key].replay()
        return self.outputs[key]

    def release(self, device: torch.device) -> None:
        """Drop the graphs (steps fall back to eager).

        Called before the process group is destroyed: a graph that captured NCCL
        collectives keeps the communicator in use, and destroying the group then hangs
        (pytorch issue 115388; seen with tensor_parallel_size 2 on two H200s).
        """
        if self.graphs:
            torch.cuda.synchronize(device)
            self.graphs.clear()
            self.outputs.clear()
