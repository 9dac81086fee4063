"""How long does one tensor-parallel all-reduce take, and would symmetric memory be faster?
(two GPUs)

Run from the repository root: NCCL_NVLS_ENABLE=0 python3 docs/diagnostics/allreduce_bench.py

Two processes, one per GPU. For the shapes a decode step reduces (rows x hidden, bf16: the
output of o_proj and of down_proj, twice per layer), each way is captured 50 times into one
CUDA graph, as the engine's decode step is, and replayed; the time per all-reduce is printed:

    nccl        torch.distributed.all_reduce (what the engine does today)
    symm 2-shot torch.ops.symm_mem.two_shot_all_reduce_ on a symmetric-memory buffer (the
                input copied in and the result copied out, as an engine would have to)
    symm 1-shot torch.ops.symm_mem.one_shot_all_reduce, likewise

Measured on two H200s, torch 2.11 (docs/raw/2026-12-01-h200x2-allreduce-bench.log): at 256 x
4096 NCCL 28.4 us, two-shot 16.6 us, one-shot 22.1 us; at 1-64 rows all three take 8-12 us.

Each symmetric-memory result is first compared with NCCL's. A way that fails (an operator
missing from this torch, a capture error) is reported with its error and skipped. Qwen3-8B's
decode step at tensor parallelism 2 does 72 all-reduces (36 layers x 2); the 0.6B shape's 56.
"""
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SHAPES = [(1, 4096), (8, 4096), (64, 4096), (256, 4096), (256, 1024)]
REPS = 50


def graph_time_us(fn) -> float:
    """Capture REPS calls of fn into one CUDA graph; microseconds per call over 20 replays."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # warm-up outside the capture (NCCL sets up its channels)
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(REPS):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(20):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / (20 * REPS) * 1e6


def run(rank: int, world: int, port: int) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, device_id=torch.device("cuda", rank))
    group_name = dist.group.WORLD.group_name
    symm = None
    try:
        import torch.distributed._symmetric_memory as symm_mem

        # (Older torch needed symm_mem.enable_symm_mem_for_group(group_name) here first;
        # torch 2.11 warns that it no longer does.)
        buffer = symm_mem.empty(max(r * h for r, h in SHAPES), dtype=torch.bfloat16,
                                device=f"cuda:{rank}")
        symm_mem.rendezvous(buffer, group_name)
        symm = buffer
    except Exception:  # reported, then the NCCL rows still run
        if rank == 0:
            print("symmetric memory unavailable:\n" + traceback.format_exc(limit=2))
    gen = torch.Generator(device="cuda").manual_seed(rank)
    for rows, hidden in SHAPES:
        x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
        expected = x.clone()
        dist.all_reduce(expected)
        y = x.clone()

        def nccl() -> None:
            y.copy_(x)
            dist.all_reduce(y)

        ways = {"nccl": nccl}
        if symm is not None:
            view = symm[: rows * hidden]

            def two_shot() -> None:
                view.copy_(x.view(-1))
                torch.ops.symm_mem.two_shot_all_reduce_(view, "sum", group_name)
                y.view(-1).copy_(view)

            def one_shot() -> None:
                view.copy_(x.view(-1))
                y.view(-1).copy_(torch.ops.symm_mem.one_shot_all_reduce(view, "sum", group_name))

            ways["symm 2-shot"] = two_shot
            ways["symm 1-shot"] = one_shot
        line = f"{rows:4d} x {hidden:5d} bf16 ({rows * hidden * 2 / 1024:7.1f} KiB):"
        for name, fn in ways.items():
            try:
                fn()
                torch.cuda.synchronize()
                err = (y.float() - expected.float()).abs().max().item()
                if err > 0.05:
                    line += f"  {name} WRONG (max err {err:.3g})"
                    continue
                line += f"  {name} {graph_time_us(fn):6.1f} us"
            except Exception as exc:  # one way failing must not hide the others
                line += f"  {name} failed ({type(exc).__name__}: {str(exc)[:60]})"
        if rank == 0:
            print(line, flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    if torch.cuda.device_count() < 2:
        sys.exit("allreduce_bench.py needs two CUDA GPUs")
    print(f"# torch {torch.__version__}, {torch.cuda.get_device_name(0)} x 2, "
          f"NCCL_NVLS_ENABLE={os.environ.get('NCCL_NVLS_ENABLE', 'unset')}; "
          f"{REPS} all-reduces per CUDA graph", flush=True)
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(run, args=(2, port), nprocs=2, join=True)
