"""Paged decode attention kernels: correctness first, then achieved memory bandwidth.

Decode reads every cached K/V byte of every sequence for a single query token, so its speed
limit is HBM bandwidth. Implementations (one query token per sequence, paged KV cache):

  naive PyTorch        a Python loop over sequences: gather its blocks, attend, next
  vectorized PyTorch   myvllm's reference: one gather of every block table, masked softmax
  Triton per-head      one program per (sequence, query head); no GQA sharing (a kv head is
                       read once per query head that uses it), no split-K
  Triton GQA+split-K   myvllm's kernel: one program per (sequence, kv head, split) loads each
                       K/V tile once for the whole query-head group; split-K for small batches

Columns: correct (max_err against the naive loop in float32, float64 for a float32 run), then
for OK rows only: ms (median of CUDA-graph replays, as the engine runs decode; L2 flushed
between runs), GB/s = (K+V bytes actually read + q + o) / time, and that as a percentage
of the measured device-to-device copy bandwidth (a large tensor copy timed in the same run,
counting read + write bytes).

--quick: tiny shapes; on a machine without a GPU the Triton kernels run in Triton's CPU
interpreter in float32 (timings there are not performance numbers). --sweep: also time a grid
of BLOCK_N / warps / stages / num_splits for our kernel at the first case (GPU only).
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
    p.add_argument("--cases", type=str, nargs="+", default=None,
                   help="BATCHxCONTEXT pairs (default 1x4096 1x32768 8x4096 64x4096 256x1024); "
                        "BATCHxLO-HI draws each context uniformly from LO..HI (seeded), as in "
                        "the end-to-end workload")
    p.add_argument("--block-sizes", type=int, nargs="+", default=None,
                   help="KV cache block sizes (default 16 256; myvllm's Config default is 16)")
    p.add_argument("--num-heads", type=int, default=None, help="query heads (default 16)")
    p.add_argument("--num-kv-heads", type=int, default=None, help="kv heads (default 8)")
    p.add_argument("--head-dim", type=int, default=None, help="head dim (default 128)")
    p.add_argument("--dtype", choices=DTYPE_NAMES, default=None,
                   help="default bfloat16 on GPU, float32 on the CPU interpreter")
    p.add_argument("--sweep", action="store_true", help="also time configs of our kernel")
    return p.parse_args()  # fmt: skip


if __name__ == "__main__":
    parse_args()  # --help and bad arguments answer here, before torch's import (seconds)

import torch  # noqa: E402

REPO = Path(__file__).resolve().parent
sys.path.insert(0, str(REPO / "src"))  # run from a checkout without installing

from benchmarks.device import kernel_device  # noqa: E402
from benchmarks.kernel_timing import bench_ms, copy_bandwidth_gbs  # noqa: E402

TOL = {torch.float32: 2e-3, torch.float16: 5e-3, torch.bfloat16: 3e-2}
DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}


def naive_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, context_lens: list[int], scale: float,
                 compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:  # fmt: skip
    """One sequence at a time, all in PyTorch (context lengths as host ints); the math runs in
    compute_dtype (float64 makes it the oracle of a float32 run)."""
    batch, hq, d = q.shape
    block_size, hkv = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)
    for b in range(batch):
        n = context_lens[b]
        pos = torch.arange(n, device=q.device)
        blocks = block_tables[b, pos // block_size].long()
        k = k_cache[blocks, pos % block_size].repeat_interleave(hq // hkv, dim=1)  # [n, Hq, D]
        v = v_cache[blocks, pos % block_size].repeat_interleave(hq // hkv, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[b].to(compute_dtype), k.to(compute_dtype)) * scale
        probs = torch.softmax(scores, -1)
        out[b] = torch.einsum("hn,nhd->hd", probs, v.to(compute_dtype)).to(q.dtype)
    return out


def parse_case(case: str) -> tuple[int, list[int]]:
    """'64x4096' -> (64, [4096] * 64); '256x100-1024' -> (256, 256 seeded lengths in 100..1024)."""
    batch_text, ctx_text = case.lower().split("x")
    batch = int(batch_text)
    if "-" not in ctx_text:
        return batch, [int(ctx_text)] * batch
    lo, hi = (int(v) for v in ctx_text.split("-"))
    gen = torch.Generator().manual_seed(batch * 7919 + hi)
    return batch, torch.randint(lo, hi + 1, (batch,), generator=gen).tolist()


def make_case(batch: int, lens: list[int], block_size: int, hq: int, hkv: int, d: int,
              dtype: torch.dtype, device: torch.device) -> dict:  # fmt: skip
    """A paged cache whose blocks are handed out in shuffled order (as after many steps);
    every block table is as wide as the longest context."""
    ctx = max(lens)
    gen = torch.Generator(device="cpu").manual_seed(batch * 100003 + ctx + block_size)
    per_seq = math.ceil(ctx / block_size)
    num_blocks = batch * per_seq
    shape = (num_blocks, block_size, hkv, d)
    k_cache = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    v_cache = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    order = torch.randperm(num_blocks, generator=gen)
    tables = order.view(batch, per_seq).to(device=device, dtype=torch.int32)
    q = torch.randn(batch, hq, d, generator=gen).to(device=device, dtype=dtype)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=device)
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, tables=tables, lens=lens_t)


def bytes_moved(lens: list[int], hq: int, hkv: int, d: int, dtype: torch.dtype) -> int:
    """K and V actually read (each sequence's own context), plus q in and o out."""
    return (2 * sum(lens) * hkv * d + 2 * len(lens) * hq * d) * dtype.itemsize


def main() -> None:
    args = parse_args()
    device = kernel_device(__file__, args.quick)
    import triton

    from benchmarks.baselines import paged_attention_decode_per_head_triton
    from myvllm.kernels.decode_attention import (
        DecodeConfig,
        choose_num_splits,
        decode_config,
        num_sms,
        paged_attention_decode_triton,
    )
    from myvllm.kernels.reference import paged_attention_decode_ref

    gpu = device.type == "cuda"
    if args.quick:
        cases, block_sizes, hq, hkv, d = ["1x37", "3x70"], [16, 256], 4, 2, 32
    else:
        cases = ["1x4096", "1x32768", "8x4096", "64x4096", "256x1024"]
        block_sizes, hq, hkv, d = [16, 256], 16, 8, 128
    cases = args.cases or cases
    block_sizes = args.block_sizes or block_sizes
    hq, hkv, d = args.num_heads or hq, args.num_kv_heads or hkv, args.head_dim or d
    dtype = DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if gpu else torch.float32)
    if hq % hkv:
        raise SystemExit(f"--num-heads {hq} must be a multiple of --num-kv-heads {hkv}")
    scale = d**-0.5
    torch.backends.cuda.matmul.allow_tf32 = False

    name = torch.cuda.get_device_name() if gpu else "CPU (Triton interpreter)"
    print(f"# paged decode attention | {name} | torch {torch.__version__} | triton "
          f"{triton.__version__} | {dtype} | heads {hq}/{hkv} | head_dim {d}")
    cfg = decode_config(device, d)
    print(f"# myvllm decode: BLOCK_N {cfg.block_n} warps {cfg.num_warps} stages "
          f"{cfg.num_stages}; num_splits from shapes (SMs: {num_sms(0) if gpu else '-'})")
    copy_gbs = copy_bandwidth_gbs(device)
    if copy_gbs:
        print(f"# measured device copy bandwidth: {copy_gbs:.0f} GB/s (read + write)")
    print("# max_err vs the naive loop in float32 (float64 for a float32 run); a NO row is "
          "not timed")
    if not gpu:
        print("# CPU interpreter: the ms column measures Python, not a GPU")
    print(f"{'batch':>5} {'ctx':>9} {'blk':>4}  {'impl':<20} {'correct':<7} {'max_err':>9} "
          f"{'ms':>9} {'GB/s':>8} {'%copy':>6}  timed")

    all_ok = True
    for case in cases:
        batch, lens = parse_case(case)
        ctx = case.lower().split("x")[1]  # for the table: "4096" or "100-1024"
        for block_size in block_sizes:
            c = make_case(batch, lens, block_size, hq, hkv, d, dtype, device)
            args_ = (c["q"], c["k_cache"], c["v_cache"], c["tables"], c["lens"], scale)
            # The oracle is the one-sequence-at-a-time loop in float32, or in float64 for a
            # float32 run (whose PyTorch rows must not be compared with themselves).
            wide = torch.float64 if dtype == torch.float32 else torch.float32
            ref = naive_decode(c["q"].to(wide), c["k_cache"], c["v_cache"], c["tables"], lens,
                               scale, compute_dtype=wide).float()  # fmt: skip
            host_lens = lens
            nbytes = bytes_moved(lens, hq, hkv, d, dtype)
            splits = choose_num_splits(batch, hkv, c["tables"].shape[1] * block_size,
                                       num_sms(0) if gpu else 4)  # fmt: skip
            impls = [
                ("naive PyTorch", lambda: naive_decode(*args_[:4], host_lens, scale)),
                ("vectorized PyTorch", lambda: paged_attention_decode_ref(*args_)),
                ("Triton per-head", lambda: paged_attention_decode_per_head_triton(*args_)),
                (f"Triton GQA split={splits}", lambda: paged_attention_decode_triton(*args_)),
            ]
            if args.quick:  # tiny shapes never choose a split: show the split-K path too
                impls.append(("Triton GQA split=4", lambda: paged_attention_decode_triton(
                    *args_, num_splits=4)))  # fmt: skip
            for label, fn in impls:
                out = fn()
                err = (out.float() - ref).abs().max().item()
                ok = bool(err <= TOL[dtype]) and not math.isnan(err)
                head = f"{batch:>5} {ctx:>9} {block_size:>4}  {label:<20}"
                if not ok:
                    all_ok = False
                    print(f"{head} {'NO':<7} {err:>9.2e}  (wrong: not timed)")
                    continue
                ms, mode = bench_ms(fn, device)
                gbs = nbytes / ms / 1e6
                pct = f"{100 * gbs / copy_gbs:6.1f}" if copy_gbs else f"{'-':>6}"
                print(f"{head} {'OK':<7} {err:>9.2e} {ms:>9.3f} {gbs:>8.0f} {pct}  {mode}")
            del c, ref
            if gpu:
                torch.cuda.empty_cache()

    if args.sweep and gpu:
        for case in cases:
            batch, lens = parse_case(case)
            for block_size in block_sizes:
                sweep(batch, lens, block_size, hq, hkv, d, dtype, device, copy_gbs, DecodeConfig,
                      paged_attention_decode_triton, make_case,
                      choose_num_splits(batch, hkv, max(lens), num_sms(0)))  # fmt: skip
    if not all_ok:
        raise SystemExit("some implementation is wrong (NO above)")


def sweep(batch, lens, block_size, hq, hkv, d, dtype, device, copy_gbs, config_cls, kernel,
          make, auto_splits) -> None:  # fmt: skip
    """Time our kernel over BLOCK_N x warps x stages x num_splits at one shape."""
    import itertools

    split_choices = [1, 2, 4] if auto_splits == 1 else [auto_splits // 2, auto_splits,
                                                         auto_splits * 2]  # fmt: skip

    c = make(batch, lens, block_size, hq, hkv, d, dtype, device)
    nbytes = bytes_moved(lens, hq, hkv, d, dtype)
    ctx = f"{min(lens)}-{max(lens)}" if min(lens) != max(lens) else str(lens[0])
    print(f"# sweep {batch}x{ctx} block_size {block_size} (auto splits {auto_splits}): "
          f"block_n warps stages splits -> ms GB/s %copy")
    for bn, warps, stages, splits in itertools.product([32, 64, 128], [4, 8], [2, 3, 4],
                                                       split_choices):  # fmt: skip
        cfg = config_cls(block_n=bn, num_warps=warps, num_stages=stages)
        try:
            fn = lambda: kernel(c["q"], c["k_cache"], c["v_cache"], c["tables"], c["lens"],  # noqa: E731
                                d**-0.5, num_splits=splits, config=cfg)  # fmt: skip
            fn()
            ms, _ = bench_ms(fn, device)
            gbs = nbytes / ms / 1e6
            print(f"  {bn:4d} {warps:2d} {stages:2d} {splits:2d}  {ms:8.4f} {gbs:7.0f} "
                  f"{100 * gbs / copy_gbs:5.1f}")
        except Exception as exc:  # out of shared memory etc.: report and continue the sweep
            print(f"  {bn:4d} {warps:2d} {stages:2d} {splits:2d}  failed: {type(exc).__name__}")


if __name__ == "__main__":
    main()
