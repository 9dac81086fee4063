"""Batch-invariant mode's matmul against cuBLAS, at the Qwen3-0.6B shapes and 1..8192 rows.

  cuBLAS        F.linear (torch's choice of kernel by shape: not batch-invariant)
  invariant     matmul_batch_invariant's Triton kernel, its plan chosen by shape (matmul_plan:
                "split" K in 512-element chunks for a decode batch, "tiles" for a prefill)
  tiles         the same kernel forced to the "tiles" plan with its large row tile (128 rows on
                a GPU) at every size: the reference bits

Columns: correct (OK: within tolerance of float32 math and, on a GPU, invariant), bits
(whether the output's bits equal tiles's, the invariance: on a GPU it must be "same"; the
CPU interpreter's dot is numpy's, whose bits may move with the tile shape),
max_err against float32 math, then ms (median of CUDA-graph replays with L2 cleared,
benchmarks/kernel_timing.py), TFLOP/s, GB/s of weights + activations read and output written,
and invariant / cuBLAS. A run with a row not "same" or not within tolerance exits non-zero.

--quick: tiny shapes; on a machine without a GPU the kernel runs in Triton's CPU interpreter in
float32 (timings there are not performance numbers).

    PYTHONPATH=src python3 -m benchmarks.benchmark_invariant_matmul
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# Qwen3-0.6B's matmuls, (out, in): qkv_proj, o_proj, gate_up_proj, down_proj, lm_head.
SHAPES = {"qkv_proj": (4096, 1024), "o_proj": (1024, 2048), "gate_up_proj": (6144, 1024),
          "down_proj": (1024, 3072), "lm_head": (151936, 1024)}
ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny shapes (CPU interpreter if no GPU)")
    p.add_argument("--rows", type=int, nargs="+", default=None, help=f"row counts {ROWS}")
    p.add_argument("--layers", nargs="+", choices=sorted(SHAPES), default=None,
                   help="which matmuls (default all)")
    return p.parse_args()  # fmt: skip


if __name__ == "__main__":
    parse_args()  # --help and bad arguments answer here, before torch's import (seconds)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "src")]  # benchmarks.* and myvllm, run as a file too

from benchmarks.device import kernel_device  # noqa: E402
from benchmarks.kernel_timing import bench_ms  # noqa: E402

TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}  # relative to the output's largest value


def main() -> None:
    args = parse_args()
    device = kernel_device(__file__, args.quick)
    import triton

    from myvllm.kernels.invariant_matmul_kernel import (invariant_matmul_triton, matmul_config,
                                                        matmul_plan)

    gpu = device.type == "cuda"
    dtype = torch.bfloat16 if gpu else torch.float32
    shapes = {"small": (48, 80), "wide": (300, 40)} if args.quick else SHAPES
    if args.layers and not args.quick:
        shapes = {name: SHAPES[name] for name in args.layers}
    rows_list = args.rows or ((1, 3, 40) if args.quick else ROWS)
    cfg = matmul_config(device, dtype)
    sms = torch.cuda.get_device_properties(device).multi_processor_count if gpu else 4
    name = torch.cuda.get_device_name() if gpu else "CPU (Triton interpreter)"
    print(f"# invariant matmul | {name} | torch {torch.__version__} | triton "
          f"{triton.__version__} | {dtype} | {cfg}")
    if not gpu:
        print("# CPU interpreter: the ms column measures Python, not a GPU")
    print(f"{'layer':<13} {'rows':>5} {'impl':<10} {'plan':<10} {'correct':<7} {'bits':<5} "
          f"{'max_err':>9} "
          f"{'ms':>8} {'TFLOP/s':>8} {'GB/s':>7} {'x_cublas':>8}  timed")
    all_ok = True
    gen = torch.Generator().manual_seed(0)
    for layer, (n, k) in shapes.items():
        w = (torch.randn(n, k, generator=gen) / k**0.5).to(device, dtype)
        for m in rows_list:
            x = torch.randn(m, k, generator=gen).to(device, dtype)
            ref = x.float() @ w.float().t()
            scale = ref.abs().max().item()
            bits = invariant_matmul_triton(x, w, plan=("tiles", cfg.block_m))
            plan = matmul_plan(m, n, k, cfg, sms)
            impls = [("cuBLAS", lambda: F.linear(x, w), "-"),
                     ("invariant", lambda: invariant_matmul_triton(x, w), f"{plan[0]}-{plan[1]}"),
                     ("tiles", lambda: invariant_matmul_triton(
                         x, w, plan=("tiles", cfg.block_m)), f"tiles-{cfg.block_m}")]
            flops = 2 * m * n * k
            moved = (m * k + n * k + m * n) * dtype.itemsize
            cublas_ms = None
            for label, fn, plan_name in impls:
                out = fn()
                err = (out.float() - ref).abs().max().item() / max(scale, 1e-30)
                same = "-" if label == "cuBLAS" else ("same" if torch.equal(out, bits) else "DIFF")
                ok = err <= TOL[dtype] and (same != "DIFF" or not gpu)
                all_ok &= ok
                head = (f"{layer:<13} {m:>5} {label:<10} {plan_name:<10} "
                        f"{'OK' if ok else 'NO':<7} {same:<5} {err:>9.2e}")
                if not ok:
                    print(f"{head}  (wrong: not timed)")
                    continue
                ms, mode = bench_ms(fn, device)
                cublas_ms = ms if label == "cuBLAS" else cublas_ms
                ratio = f"{ms / cublas_ms:>8.2f}" if cublas_ms else f"{'-':>8}"
                print(f"{head} {ms:>8.4f} {flops / ms / 1e9:>8.1f} {moved / ms / 1e6:>7.0f} "
                      f"{ratio}  {mode}")
            del x, ref, bits
        del w
        if gpu:
            torch.cuda.empty_cache()
    if not all_ok:
        raise SystemExit("some row is wrong or not invariant (above)")


if __name__ == "__main__":
    main()
