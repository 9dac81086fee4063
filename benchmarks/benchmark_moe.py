"""The experts of a MoE layer: the fused-MoE kernel against a per-expert loop and against the
time it takes just to read the active experts' weights.

Shape: one MoE layer of Qwen3-30B-A3B (128 experts, 8 per token, hidden 2048, expert
intermediate 768), bf16, for several token counts (decode batches to a long prefill).

  per-expert loop   myvllm's reference (fused_reference.fused_moe_ref): for each expert hit, gather
                    its tokens, two matmuls, scatter back; what runs on a CPU
  fused Triton      myvllm's kernel: tokens sorted by expert, one grouped matmul per
                    projection (kernels/fused_moe_kernel.py)
  fused, torch sort the same with the sorting done by ~25 PyTorch ops, at the token counts
                    where the kernel sorts in one Triton program (decode batches)

Columns: correct (max_err against the per-expert loop in float32 math), then for OK rows only:
ms (median; CUDA-graph replays for the kernel, as a decode step runs; eager for the loop,
which syncs with the host and cannot be captured), TFLOP/s (2 * tokens * 8 * 3 * 768 * 2048
multiply-adds counted twice), and the weight-read floor: the bytes of the distinct experts
the routing hits (3 * 768 * 2048 * 2 bytes each) over the measured device copy bandwidth,
and our time as a multiple of it. At a few tokens the floor is what a kernel can approach;
from a few hundred tokens all 128 experts are hit and the matmuls' arithmetic dominates.

--quick: tiny shapes; on a machine without a GPU the kernel runs in Triton's CPU interpreter in
float32 (timings there are not performance numbers). --sweep: also time tile configs of the
kernel at each token count (GPU only).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

DTYPE_NAMES = ("bfloat16", "float16", "float32")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny shapes (CPU interpreter if no GPU)")
    p.add_argument("--tokens", type=int, nargs="+", default=None,
                   help="token counts (default 1 8 64 256 1024 4096)")
    p.add_argument("--num-experts", type=int, default=None, help="experts (default 128)")
    p.add_argument("--top-k", type=int, default=None, help="experts per token (default 8)")
    p.add_argument("--hidden", type=int, default=None, help="hidden size (default 2048)")
    p.add_argument("--inter", type=int, default=None,
                   help="expert intermediate size (default 768; 384 = one of 2 TP ranks)")
    p.add_argument("--dtype", choices=DTYPE_NAMES, default=None,
                   help="default bfloat16 on GPU, float32 on the CPU interpreter")
    p.add_argument("--sweep", action="store_true", help="also time tile configs of the kernel")
    return p.parse_args()  # fmt: skip


if __name__ == "__main__":
    parse_args()  # --help and bad arguments answer here, before torch's import (seconds)

import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "src")]  # benchmarks.* and myvllm, run as a file too

from benchmarks.device import kernel_device  # noqa: E402
from benchmarks.kernel_timing import bench_ms, copy_bandwidth_gbs  # noqa: E402

# bf16: the expert outputs (up to ~4 in size) are rounded to bf16 before they are summed;
# on the CPU the per-expert loop in bf16 measured 1e-2 at 64 tokens against float32 math.
TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 5e-2}
DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}



def make_case(tokens: int, experts: int, top_k: int, hidden: int, inter: int,
              dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """Weights with std 1/sqrt(fan-in) (outputs O(1)); routing: softmax top-k of random router
    logits, renormalized (Qwen3-30B-A3B's norm_topk_prob)."""
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=gen).to(device, dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to(device, dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) / inter**0.5).to(device, dtype)
    probs = torch.softmax(torch.randn(tokens, experts, generator=gen), dim=-1)
    weights, ids = probs.topk(top_k, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    return x, w13, w2, weights.to(device), ids.to(device)


def main() -> None:
    args = parse_args()
    device = kernel_device(__file__, args.quick)
    import triton

    from myvllm.kernels.fused_reference import fused_moe_ref
    from myvllm.kernels.fused_moe_kernel import (
        ALIGN_KERNEL_MAX_PAIRS,
        MoeConfig,
        fused_moe_triton,
        moe_config,
    )

    gpu = device.type == "cuda"
    if args.quick:
        token_counts, experts, top_k, hidden, inter = [1, 5, 40], 8, 2, 64, 48
    else:
        token_counts, experts, top_k, hidden, inter = [1, 8, 64, 256, 1024, 4096], 128, 8, 2048, 768
    token_counts = args.tokens or token_counts
    experts, top_k = args.num_experts or experts, args.top_k or top_k
    hidden, inter = args.hidden or hidden, args.inter or inter
    dtype = DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if gpu else torch.float32)
    if not 1 <= top_k <= experts:
        raise SystemExit(f"--top-k {top_k} must be in 1..--num-experts {experts}")
    torch.backends.cuda.matmul.allow_tf32 = False

    name = torch.cuda.get_device_name() if gpu else "CPU (Triton interpreter)"
    print(f"# MoE experts | {name} | torch {torch.__version__} | triton {triton.__version__} | "
          f"{dtype} | {experts} experts, top-{top_k}, hidden {hidden}, intermediate {inter}")
    copy_gbs = copy_bandwidth_gbs(device)
    if copy_gbs:
        print(f"# measured device copy bandwidth: {copy_gbs:.0f} GB/s (read + write)")
    print("# max_err vs the per-expert loop with float32 math (float64 for a float32 run); "
          "a NO row is not timed")
    if not gpu:
        print("# CPU interpreter: the ms column measures Python, not a GPU")
    print(f"{'tokens':>6} {'hit':>4}  {'impl':<18} {'correct':<7} {'max_err':>9} {'ms':>9} "
          f"{'TFLOP/s':>8} {'floor_ms':>8} {'x_floor':>7}  timed")

    all_ok = True
    expert_bytes = 3 * inter * hidden * dtype.itemsize
    for tokens in token_counts:
        x, w13, w2, weights, ids = make_case(tokens, experts, top_k, hidden, inter, dtype, device)
        wide = torch.float64 if dtype == torch.float32 else torch.float32
        ref = fused_moe_ref(x.to(wide), w13.to(wide), w2.to(wide), weights, ids).float()
        hit = int(ids.unique().numel())
        flops = 2 * tokens * top_k * 3 * inter * hidden
        floor_ms = hit * expert_bytes / copy_gbs / 1e6 if copy_gbs else None
        impls = [
            ("per-expert loop", lambda: fused_moe_ref(x, w13, w2, weights, ids), False),
            ("fused Triton", lambda: fused_moe_triton(x, w13, w2, weights, ids), True),
        ]
        if tokens * top_k <= ALIGN_KERNEL_MAX_PAIRS:
            impls.append(("fused, torch sort", lambda: fused_moe_triton(
                x, w13, w2, weights, ids, align_kernel=False), True))  # fmt: skip
        for label, fn, graph in impls:
            out = fn()
            err = (out.float() - ref).abs().max().item()
            ok = bool(err <= TOL[dtype]) and not math.isnan(err)
            head = f"{tokens:>6} {hit:>4}  {label:<18}"
            if not ok:
                all_ok = False
                print(f"{head} {'NO':<7} {err:>9.2e}  (wrong: not timed)")
                continue
            ms, mode = bench_ms(fn, device, graph=graph and gpu)
            floor = (f"{floor_ms:>8.3f} {ms / floor_ms:>7.2f}" if floor_ms
                     else f"{'-':>8} {'-':>7}")  # fmt: skip
            print(f"{head} {'OK':<7} {err:>9.2e} {ms:>9.3f} {flops / ms / 1e9:>8.1f} {floor}  "
                  f"{mode}")
        if args.sweep and gpu:
            auto = moe_config(tokens * top_k, experts)
            print(f"#   sweep at {tokens} tokens (auto: {auto}): block_m n k warps stages -> ms")
            for bm in (16, 32, 64):
                for bn, bk in ((64, 64), (64, 128), (128, 64), (128, 128)):
                    for warps, stages in ((4, 3), (4, 4), (8, 3)):
                        cfg = MoeConfig(bm, bn, bk, warps, stages)
                        try:
                            ms, _ = bench_ms(lambda: fused_moe_triton(  # noqa: B023
                                x, w13, w2, weights, ids, cfg), device)
                            print(f"    {bm:3d} {bn:4d} {bk:4d} {warps:2d} {stages:2d}  {ms:8.4f}")
                        except Exception as exc:  # out of shared memory etc.: report, go on
                            print(f"    {bm:3d} {bn:4d} {bk:4d} {warps:2d} {stages:2d}  failed: "
                                  f"{type(exc).__name__}")
        del x, w13, w2, ref
        if gpu:
            torch.cuda.empty_cache()
    if not all_ok:
        raise SystemExit("some implementation is wrong (NO above)")


if __name__ == "__main__":
    main()
