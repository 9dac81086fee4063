"""Per-call time of the sampling kernels inside a CUDA graph, by chunk size (GPU only).

Run from the repository root: python3 docs/diagnostics/sampler_diag.py
Logits are bf16 [batch, 151936] (Qwen3's vocabulary), temperature 1 (sampled rows).
In the log docs/raw/2026-11-30c-h200-sampler-diag.log the GB/s column is 1000x too small
(a unit slip in the script that wrote it); its times are right.
"""
import sys

sys.path.insert(0, "src")
import torch

from myvllm.kernels.sample_kernel import gumbel_sample_triton

REPS = 20


def graph_time(fn) -> float:
    """Microseconds per call, REPS calls captured in one graph, replayed 10 times."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(REPS):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(True), torch.cuda.Event(True)
    start.record()
    for _ in range(10):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / (10 * REPS) * 1e3


torch.manual_seed(0)
for batch in (1, 8, 64, 256):
    logits = torch.randn(batch, 151936, device="cuda", dtype=torch.bfloat16) * 3
    temps = torch.ones(batch, device="cuda")
    seeds = torch.randint(0, 2**31 - 1, (batch,), device="cuda")
    read_bytes = logits.numel() * logits.element_size()
    line = f"batch {batch:3d}:"
    for chunk_size in (1024, 2048, 4096, 8192):
        us = graph_time(lambda: gumbel_sample_triton(logits, temps, seeds, chunk_size))
        line += f"  chunk {chunk_size} {us:7.1f} us ({read_bytes / us / 1e3:5.0f} GB/s)"
    print(line, flush=True)
