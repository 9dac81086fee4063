"""The decode attention kernel's two programs for the scores, over a bf16 and an fp8 cache.

  dot          decode_attention.py's program: the query heads of a kv head padded to 16 rows
               for tl.dot (DECODE_SCORES = "dot")
  cuda_cores   decode_attention.py's CUDA-core program: the scores as products summed on the CUDA cores
               over the real heads only (DECODE_SCORES = "cuda_cores")

each at a few tiles (BLOCK_N / num_warps / num_stages[/ keys_per_row]; "default" is
decode_config's choice),
on Qwen3-0.6B's attention (16 query heads, 8 kv heads: 2 query heads a kv head, head_dim 128,
16-token blocks in shuffled order) at two shapes:

  bench   256 decode rows, contexts uniform in 100..1100 (mean ~600, seeded): a full-batch
          step of benchmark_tps.py's workload
  long    64 decode rows of 8,000 tokens: the long-context workload (64 prompts of 8,000
          tokens, 512 output tokens each)

One line per (shape, cache, program, tile): correct (OK: within tolerance of the float32
reference on the same cache), max_err, us a call (median of CUDA-graph replays, L2 cleared:
benchmarks/kernel_timing.py), GB/s of K and V bytes read, and the time against the bf16
cache's dot program at its default tile (x_bf16_dot, < 1 is faster). After all lines, the
fastest correct tile of each (shape, cache, program). A row not within tolerance makes the
run exit non-zero. "auto" rows are what the engine runs (DECODE_SCORES as set).

--quick: tiny shapes; on a machine without a GPU the kernels run in Triton's CPU interpreter
in fp16 (the interpreter's bf16 dot is wrong; timings there are not performance numbers).

    PYTHONPATH=src python3 -m benchmarks.benchmark_decode_attention
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

SHAPES = ("bench", "long")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny shapes (CPU interpreter if no GPU)")
    p.add_argument("--shapes", nargs="+", choices=SHAPES, default=list(SHAPES))
    p.add_argument("--block-size", type=int, default=16, help="KV cache block size (default 16)")
    return p.parse_args()  # fmt: skip


if __name__ == "__main__":
    parse_args()  # --help and bad arguments answer here, before torch's import (seconds)

import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "src")]  # benchmarks.* and myvllm, run as a file too

from benchmarks.device import kernel_device  # noqa: E402
from benchmarks.kernel_timing import bench_ms  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 16, 8, 128
K_SCALE, V_SCALE = 0.37, 1.9  # not 1.0, so that a dropped scale shows as an error
# Tiles timed besides the default: (BLOCK_N, num_warps, num_stages[, keys_per_row]); the
# CUDA-core program's state rows are BLOCK_N / keys_per_row, best a multiple of 4 x warps
# (its layout: 4 rows a warp).
DOT_TILES = [(64, 4, 3), (64, 2, 4), (32, 4, 3), (32, 2, 4), (128, 4, 3)]
CUDA_CORE_TILES = [(16, 4, 2, 1), (16, 4, 3, 1), (16, 4, 4, 1), (16, 2, 3, 1), (32, 8, 3, 1),
                   (32, 4, 3, 1), (64, 8, 3, 1),
                   (32, 4, 2, 2), (32, 4, 3, 2), (32, 4, 4, 2), (16, 2, 3, 2), (32, 2, 3, 2),
                   (64, 8, 2, 2), (64, 8, 3, 2), (64, 4, 3, 2), (64, 8, 4, 2)]
TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3}  # max abs error, outputs of size ~0.1-1


def make_case(batch: int, lengths: list[int], block_size: int, cache_dtype: torch.dtype,
              dtype: torch.dtype, device: torch.device, heads: int, kv_heads: int,
              head_dim: int) -> tuple:
    """q, caches of shuffled blocks (fp8: K / K_SCALE and V / V_SCALE, as the store kernel
    writes them), block tables, context lengths, scales."""
    from myvllm.kernels.fp8_kv_reference import quantize_kv

    gen = torch.Generator(device).manual_seed(0)
    per_seq = [-(-n // block_size) for n in lengths]
    num_blocks = sum(per_seq) + 1
    shape = (num_blocks, block_size, kv_heads, head_dim)
    fp8 = cache_dtype.itemsize == 1
    scales = (K_SCALE, V_SCALE) if fp8 else (1.0, 1.0)
    caches = [quantize_kv(torch.randn(shape, generator=gen, device=device), cache_dtype, scale)
              for scale in scales]
    order = torch.randperm(num_blocks, generator=gen, device=device).cpu()
    tables = torch.zeros(batch, max(per_seq), dtype=torch.int32)
    used = 0
    for b, n in enumerate(per_seq):
        tables[b, :n] = order[used:used + n]
        used += n
    q = torch.randn(batch, heads, head_dim, generator=gen, device=device).to(dtype)
    ctx = torch.tensor(lengths, dtype=torch.int32, device=device)
    return q, caches[0], caches[1], tables.to(device), ctx, scales


def shapes(quick: bool) -> dict[str, tuple[int, list[int]]]:
    import random

    rng = random.Random(0)
    if quick:
        return {"quick": (3, [1, 45, 30])}
    return {"bench": (256, [rng.randint(100, 1100) for _ in range(256)]),
            "long": (64, [8000] * 64)}


def main() -> None:
    args = parse_args()
    device = kernel_device(__file__, args.quick)
    import triton

    from myvllm.kernels import decode_attention
    from myvllm.kernels.decode_attention import DecodeConfig, paged_attention_decode_triton
    from myvllm.kernels.fp8_kv_reference import FP8_DTYPE
    from myvllm.kernels.reference import paged_attention_decode_ref

    gpu = device.type == "cuda"
    dtype = torch.bfloat16 if gpu else torch.float16
    heads, kv_heads, head_dim = (HEADS, KV_HEADS, HEAD_DIM) if gpu else (4, 2, 32)
    name = torch.cuda.get_device_name() if gpu else "CPU (Triton interpreter)"
    print(f"# decode attention | {name} | torch {torch.__version__} | triton "
          f"{triton.__version__} | {dtype} queries | heads {heads}/{kv_heads} | head_dim "
          f"{head_dim} | block {args.block_size} | DECODE_SCORES={decode_attention.DECODE_SCORES}")
    if not gpu:
        print("# CPU interpreter: the us column measures Python, not a GPU")
    print(f"{'shape':<6} {'cache':<5} {'program':<10} {'tile':<10} {'splits':>6} {'correct':<7} "
          f"{'max_err':>8} {'us':>9} {'GB/s':>7} {'x_bf16_dot':>10}  timed")
    cases = shapes(args.quick)
    all_ok = True
    best: list[str] = []
    for shape, (batch, lengths) in cases.items():
        if not args.quick and shape not in args.shapes:
            continue
        baseline_us = None
        sixteen = "bf16" if dtype == torch.bfloat16 else "fp16"
        for cache_name, cache_dtype in ((sixteen, dtype), ("fp8", FP8_DTYPE)):
            q, k_cache, v_cache, tables, ctx, (ks, vs) = make_case(
                batch, lengths, args.block_size, cache_dtype, dtype, device, heads, kv_heads,
                head_dim)
            ref = paged_attention_decode_ref(q, k_cache, v_cache, tables, ctx, head_dim**-0.5,
                                             ks, vs)
            kv_bytes = 2 * sum(lengths) * kv_heads * head_dim * cache_dtype.itemsize
            group = heads // kv_heads
            for program in ("auto", "dot", "cuda_cores"):
                cuda_cores = decode_attention.uses_cuda_cores(program, group, cache_dtype)
                if program == "auto":
                    tiles = [None]
                elif args.quick:  # the default, and two keys a row for the CUDA cores
                    tiles = [None, (32, 4, 1, 2)] if cuda_cores else [None]
                else:
                    tiles = [None, *(CUDA_CORE_TILES if cuda_cores else DOT_TILES)]
                fastest: tuple[float, str] | None = None
                for tile in tiles:
                    cfg = None if tile is None else DecodeConfig(*tile)
                    shown = decode_attention.decode_config(device, head_dim, cache_dtype,
                                                           cuda_cores=cuda_cores, group=group)
                    label = "default" if tile is None else "/".join(map(str, tile))
                    splits = decode_attention.choose_num_splits(
                        batch, kv_heads, tables.shape[1] * args.block_size,
                        decode_attention.num_sms(device.index or 0) if gpu else 4)

                    def call(cfg: DecodeConfig | None = cfg, program: str = program) -> torch.Tensor:
                        return paged_attention_decode_triton(
                            q, k_cache, v_cache, tables, ctx, head_dim**-0.5, config=cfg,
                            k_scale=ks, v_scale=vs,
                            scores=None if program == "auto" else program)

                    try:
                        out = call()
                    except Exception as error:  # a tile Triton cannot compile: say so, go on
                        print(f"{shape:<6} {cache_name:<5} {program:<10} {label:<10} {splits:>6} "
                              f"{'-':<7} ({type(error).__name__}: {str(error)[:80]})")
                        continue
                    err = (out.float() - ref.float()).abs().max().item()
                    ok = err <= TOL[dtype] and not torch.isnan(out).any().item()
                    all_ok &= ok
                    head = (f"{shape:<6} {cache_name:<5} {program:<10} {label:<10} {splits:>6} "
                            f"{'OK' if ok else 'NO':<7} {err:>8.1e}")
                    if not ok:
                        print(f"{head}  (wrong: not timed)")
                        continue
                    ms, mode = bench_ms(call, device)
                    us = 1e3 * ms
                    if cache_name == sixteen and program == "dot" and tile is None:
                        baseline_us = us
                    ratio = f"{us / baseline_us:>10.3f}" if baseline_us else f"{'-':>10}"
                    tile_used = label if tile else "/".join(map(str, (
                        shown.block_n, shown.num_warps, shown.num_stages, shown.keys_per_row)))
                    print(f"{head} {us:>9.1f} {kv_bytes / ms / 1e6:>7.0f} {ratio}  {mode}"
                          + ("" if tile else f" (tile {tile_used})"), flush=True)
                    if program != "auto" and (fastest is None or us < fastest[0]):
                        fastest = (us, tile_used)
                if fastest is not None:
                    best.append(f"# fastest {shape:<6} {cache_name:<5} {program:<10} tile "
                                f"{fastest[1]:<10} {fastest[0]:9.1f} us")
            del q, k_cache, v_cache, tables, ref
            if gpu:
                torch.cuda.empty_cache()
    print("\n".join(best))
    if not all_ok:
        raise SystemExit("some row is not within tolerance of the reference (above)")


if __name__ == "__main__":
    main()
