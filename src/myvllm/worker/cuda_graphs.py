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
from typing import Any, Protocol

import torch

from myvllm.engine.batch import StepInputs
from myvllm.engine.sequence import Sequence
from myvllm.layers.sampler import Sampler
from myvllm.sample.sampling_controls import needs_full_sampler
from myvllm.utils.context import forward_context
from myvllm.worker.input_builder import InputBuilder
from myvllm.worker.model_loading import CausalLM

GraphKey = tuple[str, int]  # (kind of step, padded size)


class GraphRunner(Protocol):
    """A ModelRunner (engine/model_runner.py), as its decode graphs see it."""

    model: CausalLM
    sampler: Sampler
    inputs: InputBuilder

    def run_graph_or_eager(self, key: GraphKey | None, step: StepInputs,
                           forward: Callable[[StepInputs], torch.Tensor]) -> torch.Tensor: ...

    def decode_logits(self, step: StepInputs) -> torch.Tensor | None: ...


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


def decode_forward(runner: GraphRunner, step: StepInputs, sample: bool,
                   all_greedy: bool = False) -> torch.Tensor:
    """One decode step (what a decode graph captures): the hidden states of all (padded)
    rows; with `sample`, the LM head and the temperature-only sampler into the pool too
    (a graph, captured with all_greedy=False, serves greedy batches alike)."""
    hidden = runner.model(step.input_ids, step.positions)
    if sample:
        assert step.sampled is not None and step.temperatures is not None
        logits = runner.model.compute_logits(hidden)
        step.sampled.copy_(runner.sampler(logits, step.temperatures, all_greedy=all_greedy))
    return hidden


def decode_sampling_in_graph(runner: GraphRunner, seqs: list[Sequence]) -> torch.Tensor | None:
    """ModelRunner.run_decode with one GPU, whose decode graphs sample too: None, the tokens
    in the pool; a batch that needs the full sampler (filters, seeds, a feature's logits:
    sample/sampling_controls.py) gets its logits instead, the graph's sampling unused."""
    step = runner.inputs.prepare_decode(seqs)
    if needs_full_sampler(seqs):
        return runner.decode_logits(step)
    all_greedy = all(seq.sampling_params.temperature == 0 for seq in seqs)
    # A graph samples with all_greedy=False (see decode_forward): the same tokens.
    key = ("decode", step.input_ids.size(0)) if runner.inputs.padded is not None else None
    with forward_context(step.context):
        runner.run_graph_or_eager(key, step,
                                  lambda step: decode_forward(runner, step, True, all_greedy))
    return None
