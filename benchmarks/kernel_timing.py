"""How the kernel benchmarks time a call on the GPU (a CUDA graph's replay, L2 cleared) and the
copy bandwidth they report beside it; benchmark_decoding.py and benchmarks/benchmark_moe.py
share them."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def bench_ms(fn: Callable[[], object], device: torch.device, graph: bool = True
             ) -> tuple[float, str]:  # fmt: skip
    """Median ms of fn, and how it was timed.

    On the GPU the call is captured in a CUDA graph and the graph's replay is timed, the way
    the engine runs decode: a small decode step takes less GPU time than Python needs to
    launch its kernels, so timing eager calls would measure the launcher. (Capturing also
    checks the implementation is graph-safe.) If capture fails, the eager call is timed and
    the row says so.
    """
    if device.type != "cuda":
        fn()
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3, "cpu"
    import triton.testing

    if not graph:
        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")), "eager"
    mode, target = "graph", fn
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()  # warm-up off the default stream, as torch.cuda.graph requires
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        target = graph.replay
    except RuntimeError as exc:
        mode = f"eager ({type(exc).__name__}: {str(exc)[:40]})"
        torch.cuda.synchronize()
    # do_bench clears the L2 cache before every run: we measure HBM, not L2.
    return float(triton.testing.do_bench(target, warmup=25, rep=100, return_mode="median")), mode


def copy_bandwidth_gbs(device: torch.device) -> float | None:
    """Device-to-device copy of 2 GiB: (read + write bytes) / time."""
    if device.type != "cuda":
        return None
    src = torch.empty(2**30, dtype=torch.int16, device=device).fill_(1)
    dst = torch.empty_like(src)
    # One big kernel: eager timing. (A captured copy_ replayed slower here, 2.8 vs 4.3 TB/s.)
    ms, _ = bench_ms(lambda: dst.copy_(src), device, graph=False)
    nbytes = 2 * src.numel() * src.element_size()
    del src, dst
    torch.cuda.empty_cache()
    return nbytes / ms / 1e6
