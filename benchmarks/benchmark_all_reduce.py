"""The tensor-parallel all-reduce: NCCL against torch's symmetric-memory kernels, per message size.

    python3 benchmarks/benchmark_all_reduce.py          # 2 GPUs, hidden 4096 (Qwen3-8B)
    python3 benchmarks/benchmark_all_reduce.py --world-size 4 --hidden 5120

Spawns one process per GPU. For every size from 1 to 256 rows x hidden (bf16), first the
correctness of each kernel (its sum against NCCL's, on random partials), then microseconds per
all-reduce: eager (a loop of calls, timed with CUDA events) and inside a CUDA graph (20 calls
captured in one graph, replayed), as the engine runs its decode steps. The last lines give the
thresholds the measurement implies for src/myvllm/utils/symm_mem.py (the largest message each
kernel still wins in a graph). Multicast stays off (no multimem_* kernel is timed).
"""

from __future__ import annotations

import argparse
import os
import socket
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
CALLS_PER_GRAPH = 20
EAGER_CALLS = 200


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, default=2, help="GPUs (default: 2)")
    parser.add_argument("--hidden", type=int, default=4096,
                        help="elements per row: the model's hidden size (default: 4096)")
    parser.add_argument("--repeats", type=int, default=5,
                        help="timings per case; the median is shown (default: 5)")
    return parser.parse_args()


def time_us(fn: Callable[[], Any], calls: int, repeats: int) -> float:
    """Median over repeats of the microseconds per call of fn (fn itself makes `calls`)."""
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        dist.barrier()
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) * 1000 / calls)
    return sorted(samples)[len(samples) // 2]


def in_graph(call: Callable[[], Any]) -> Callable[[], Any]:
    """CALLS_PER_GRAPH calls of `call` captured in one CUDA graph; returns its replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # warm-up outside the graph (NCCL's lazy set-up)
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS_PER_GRAPH):
            call()
    return graph.replay


def rank_main(rank: int, world_size: int, port: int, args: argparse.Namespace,
              results: Any) -> None:
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off, also in NCCL
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, device_id=device)
    from myvllm.utils.symm_mem import SymmMemAllReduce

    max_bytes = max(ROWS) * args.hidden * 2
    kernels = {"two_shot": SymmMemAllReduce(device, max_bytes, one_shot_max_bytes=0),
               "one_shot": SymmMemAllReduce(device, max_bytes, one_shot_max_bytes=max_bytes)}
    rows_out = []
    for rows in ROWS:
        gen = torch.Generator(device=device).manual_seed(1000 * rows + rank)
        partial = torch.randn(rows, args.hidden, device=device, dtype=torch.bfloat16,
                              generator=gen)
        expected = partial.clone()
        dist.all_reduce(expected)
        row: dict[str, Any] = {"rows": rows, "bytes": partial.numel() * 2}
        for name, kernel in kernels.items():
            got = kernel.all_reduce(partial.clone())
            # Two ranks add the same two numbers either way; more may add in another order.
            exact = torch.equal(got, expected)
            close = torch.allclose(got.float(), expected.float(), rtol=1e-2, atol=1e-2)
            row[f"{name}_ok"] = exact if world_size == 2 else close
        x = partial.clone()
        calls: dict[str, Callable[[], Any]] = {"nccl": lambda: dist.all_reduce(x)}
        for name, kernel in kernels.items():
            calls[name] = (lambda k: lambda: k.all_reduce(x))(kernel)
        for name, call in calls.items():
            def eager(call: Callable[[], Any] = call) -> None:
                for _ in range(EAGER_CALLS):
                    call()
            row[f"{name}_eager"] = time_us(eager, EAGER_CALLS, args.repeats)
            row[f"{name}_graph"] = time_us(in_graph(call), CALLS_PER_GRAPH, args.repeats)
        rows_out.append(row)
    if rank == 0:
        results.put(rows_out)
    dist.barrier()
    kernels.clear()
    dist.destroy_process_group()


def report(rows: list[dict[str, Any]], world_size: int, hidden: int) -> None:
    print(f"all-reduce of rows x {hidden} bf16 over {world_size} GPUs, us per call")
    print("correctness (against NCCL's sum): "
          + ", ".join(f"{r['rows']} rows two-shot {'OK' if r['two_shot_ok'] else 'WRONG'} "
                      f"one-shot {'OK' if r['one_shot_ok'] else 'WRONG'}" for r in rows))
    header = (f"{'rows':>5} {'KiB':>7} | {'eager: nccl':>11} {'two-shot':>9} {'one-shot':>9} "
              f"| {'graph: nccl':>11} {'two-shot':>9} {'one-shot':>9} | best in graph")
    print(header)
    for r in rows:
        best = min(("nccl", "two_shot", "one_shot"), key=lambda k: r[f"{k}_graph"])
        print(f"{r['rows']:>5} {r['bytes'] / 1024:>7.0f} | {r['nccl_eager']:>11.1f} "
              f"{r['two_shot_eager']:>9.1f} {r['one_shot_eager']:>9.1f} | "
              f"{r['nccl_graph']:>11.1f} {r['two_shot_graph']:>9.1f} "
              f"{r['one_shot_graph']:>9.1f} | {best}")
    ok = all(r["two_shot_ok"] and r["one_shot_ok"] for r in rows)
    one_shot = [r["bytes"] for r in rows
                if r["one_shot_graph"] < min(r["two_shot_graph"], r["nccl_graph"])]
    symm = [r["bytes"] for r in rows
            if min(r["one_shot_graph"], r["two_shot_graph"]) < r["nccl_graph"]]
    print(f"thresholds for src/myvllm/utils/symm_mem.py{'' if ok else ' (a kernel was WRONG)'}"
          f": ONE_SHOT_MAX_BYTES = {max(one_shot, default=0)}, "
          f"TWO_SHOT_MAX_BYTES = {max(symm, default=0)}"
          f"{' (the largest size measured: larger may win too)' if symm and max(symm) == rows[-1]['bytes'] else ''}")


def main() -> None:
    args = parse_args()
    if torch.cuda.device_count() < args.world_size:
        raise SystemExit(f"needs {args.world_size} GPUs, {torch.cuda.device_count()} visible")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    mp.start_processes(rank_main, args=(args.world_size, port, args, results),
                       nprocs=args.world_size, start_method="spawn")
    report(results.get(), args.world_size, args.hidden)


if __name__ == "__main__":
    main()
