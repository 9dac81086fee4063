"""Prefill attention kernels: correctness first, then speed and memory.

Implementations (causal attention of B sequences of S tokens, GQA Hq/Hkv heads, head_dim D):

  PyTorch standard   materialises the [B, Hq, S, S] score matrix (O(S^2) memory)
  Naive Triton       one program per (sequence, head) holds the WHOLE sequence as one tile;
                     only sequences up to NAIVE_PREFILL_MAX_SEQLEN tokens fit on chip, longer
                     ones are skipped with that reason
  myvllm flash       our flash_attention_varlen (online softmax, BLOCK_M x BLOCK_N tiles)
  torch SDPA         F.scaled_dot_product_attention(is_causal=True): the outside anchor.
                     It gets K/V already expanded to Hq heads (done before timing)

--prefix P: every sequence has P tokens already in a paged KV cache (16-token blocks in a
shuffled order) before its S new ones, as after a prefix-cache hit. Our kernel then reads K/V
through the block table, SDPA gets the whole context and a lower-right causal mask
(torch.nn.attention.bias.causal_lower_right), and causal FLOPs count S*P + S^2/2 per head.
The two dense baselines have no cached prefix and are skipped.

--cuda-graph: time every row as a replayed CUDA graph (triton.testing.do_bench_cudagraph), so
the host's launch cost is left out, as it is for the engine's graph-replayed steps.

For every row: max_err against a float32 reference (SDPA on float32 inputs; float64 when the
run itself is float32), OK/NO, and only
for OK rows: ms (median), TFLOP/s with causal FLOPs = 4 * S^2/2 * D * Hq per sequence,
the extra peak memory the call allocated (torch.cuda.max_memory_allocated, reset per
implementation), and the speed ratio SDPA_ms / ms (> 1 means faster than SDPA).

--quick: tiny shapes; on a machine without a GPU the Triton kernels run in Triton's CPU
interpreter in float32 (timings there are not performance numbers). --sweep: also time a
grid of tile configurations of our kernel (tuning aid, GPU only).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

DTYPE_NAMES = ("bfloat16", "float16", "float32")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny shapes (CPU interpreter if no GPU)")
    p.add_argument("--seq-lens", type=int, nargs="+", default=None,
                   help="sequence lengths (default 128 512 1024 2048 4096 8192 16384)")
    p.add_argument("--batch", type=int, default=None, help="sequences per call (default 2)")
    p.add_argument("--num-heads", type=int, default=None, help="query heads (default 16)")
    p.add_argument("--num-kv-heads", type=int, default=None, help="kv heads (default 8)")
    p.add_argument("--head-dim", type=int, default=None, help="head dim (default 128)")
    p.add_argument("--dtype", choices=DTYPE_NAMES, default=None,
                   help="default bfloat16 on GPU, float32 on the CPU interpreter")
    p.add_argument("--prefix", type=int, default=0, metavar="P",
                   help="tokens of cached prefix before each sequence's new ones (default 0)")
    p.add_argument("--cuda-graph", action="store_true",
                   help="time rows as replayed CUDA graphs (no host launch cost)")
    p.add_argument("--sweep", action="store_true", help="also time tile configs of our kernel")
    return p.parse_args()  # fmt: skip


if __name__ == "__main__":
    parse_args()  # --help and bad arguments answer here, before torch's import (seconds)

import torch  # noqa: E402

REPO = Path(__file__).resolve().parent
sys.path.insert(0, str(REPO / "src"))  # run from a checkout without installing

from benchmarks.device import kernel_device  # noqa: E402

TOL = {torch.float32: 2e-3, torch.float16: 5e-3, torch.bfloat16: 3e-2}
DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}



def bench_ms(fn: Callable[[], object], device: torch.device, cuda_graph: bool = False) -> float:
    if device.type == "cuda":
        import triton.testing

        if cuda_graph:
            return float(triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median"))
        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    fn()
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def peak_extra_mb(fn: Callable[[], object], device: torch.device) -> float | None:
    """Memory the call allocates on top of what already exists (inputs, other buffers)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def standard_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """[B, H, S, D] inputs, K/V already expanded to H heads: the textbook three lines."""
    seq = q.shape[2]
    scores = (q @ k.transpose(-1, -2)) * scale
    causal = torch.ones(seq, seq, dtype=torch.bool, device=q.device).triu(1)
    scores = scores.masked_fill(causal, float("-inf"))
    return torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v


def main() -> None:
    args = parse_args()
    device = kernel_device(__file__, args.quick)
    import torch.nn.functional as F
    import triton

    from benchmarks.baselines import NAIVE_PREFILL_MAX_SEQLEN, naive_attention_prefill_triton
    from myvllm.kernels.prefill_attention import (
        PrefillConfig,
        flash_attention_varlen_triton,
        prefill_config,
    )

    gpu = device.type == "cuda"
    quick_defaults = dict(seq_lens=[16, 40], batch=2, num_heads=4, num_kv_heads=2, head_dim=32)
    full_defaults = dict(seq_lens=[128, 512, 1024, 2048, 4096, 8192, 16384], batch=2,
                         num_heads=16, num_kv_heads=8, head_dim=128)  # fmt: skip
    defaults = quick_defaults if args.quick else full_defaults
    seq_lens = args.seq_lens or defaults["seq_lens"]
    batch = args.batch or defaults["batch"]
    hq = args.num_heads or defaults["num_heads"]
    hkv = args.num_kv_heads or defaults["num_kv_heads"]
    d = args.head_dim or defaults["head_dim"]
    dtype = DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if gpu else torch.float32)
    if hq % hkv:
        raise SystemExit(f"--num-heads {hq} must be a multiple of --num-kv-heads {hkv}")
    scale = d**-0.5
    group = hq // hkv
    torch.backends.cuda.matmul.allow_tf32 = False  # the float32 reference must be float32

    name = torch.cuda.get_device_name() if gpu else "CPU (Triton interpreter)"
    print(f"# prefill attention | {name} | torch {torch.__version__} | triton "
          f"{triton.__version__} | {dtype} | batch {batch} | heads {hq}/{hkv} | head_dim {d}")
    cfg = prefill_config(device, d)
    print(f"# myvllm flash tiles: BLOCK_M {cfg.block_m} BLOCK_N {cfg.block_n} "
          f"warps {cfg.num_warps} stages {cfg.num_stages} tma {cfg.use_tma}")
    prefix = args.prefix
    if prefix < 0:
        raise SystemExit(f"--prefix must be >= 0, got {prefix}")
    if prefix:
        print(f"# cached prefix: {prefix} tokens per sequence, read through a block table")
    if args.cuda_graph:
        print("# timed as replayed CUDA graphs (no host launch cost)")
    print("# max_err vs a float32 reference; a NO row is not timed; vs_SDPA = SDPA ms / ms")
    if not gpu:
        print("# CPU interpreter: the ms column measures Python, not a GPU")
    header = f"{'seq_len':>7}  {'impl':<18} {'correct':<7} {'max_err':>9} {'ms':>9} " \
             f"{'TFLOP/s':>8} {'peak_MB':>9} {'vs_SDPA':>7}"  # fmt: skip
    print(header)

    all_ok = True
    for seq in seq_lens:
        gen = torch.Generator(device="cpu").manual_seed(seq)
        n = batch * seq
        ctx = prefix + seq  # keys each sequence's last query row sees
        q = torch.randn(n, hq, d, generator=gen).to(device=device, dtype=dtype)
        # K/V of every context position, [B * ctx, Hkv, D]; the last seq of each are the new ones.
        k_all = torch.randn(batch * ctx, hkv, d, generator=gen).to(device=device, dtype=dtype)
        v_all = torch.randn(batch * ctx, hkv, d, generator=gen).to(device=device, dtype=dtype)
        new_rows = (torch.arange(batch)[:, None] * ctx + prefix + torch.arange(seq)).flatten()
        k, v = k_all[new_rows.to(device)], v_all[new_rows.to(device)]
        cu = torch.arange(0, n + 1, seq, dtype=torch.int32, device=device)
        cu_k = torch.arange(0, batch * ctx + 1, ctx, dtype=torch.int32, device=device)
        paged = paged_cache(k_all, v_all, batch, ctx, gen) if prefix else None
        # [B, H, S, D] copies for the dense implementations, K/V expanded to Hq heads.
        qd = q.view(batch, seq, hq, d).transpose(1, 2).contiguous()
        kd = k_all.view(batch, ctx, hkv, d).transpose(1, 2).repeat_interleave(group, 1).contiguous()
        vd = v_all.view(batch, ctx, hkv, d).transpose(1, 2).repeat_interleave(group, 1).contiguous()
        ref = sdpa_oracle(qd, kd, vd, scale).transpose(1, 2).reshape(n, hq, d)
        flops = batch * 4 * (seq * prefix + seq * seq / 2) * d * hq

        def dense(out: torch.Tensor) -> torch.Tensor:
            return out.transpose(1, 2).reshape(n, hq, d)

        def ours() -> torch.Tensor:
            if paged is None:
                return flash_attention_varlen_triton(q, k, v, cu, cu, seq, seq, scale)
            k_cache, v_cache, block_tables = paged
            return flash_attention_varlen_triton(q, k, v, cu, cu_k, seq, ctx, scale,
                                                 block_tables=block_tables, k_cache=k_cache,
                                                 v_cache=v_cache)  # fmt: skip

        standard_bytes = batch * hq * seq * seq * (dtype.itemsize * 2 + 4) + seq * seq
        free = torch.cuda.mem_get_info()[0] if gpu else 8 * 2**30
        no_prefix = "SKIP: no cached prefix here" if prefix else ""
        impls: list[tuple[str, Callable[[], torch.Tensor] | None, str]] = [
            ("PyTorch standard", lambda: dense(standard_attention(qd, kd, vd, scale)),
             no_prefix or ("" if standard_bytes < 0.5 * free else
                           f"SKIP: needs ~{standard_bytes / 2**30:.0f} GiB for the S x S scores")),
            ("Naive Triton", lambda: naive_attention_prefill_triton(q, k, v, cu, seq, scale),
             no_prefix or ("" if triton.next_power_of_2(seq) <= NAIVE_PREFILL_MAX_SEQLEN else
                           f"SKIP: one tile holds at most {NAIVE_PREFILL_MAX_SEQLEN} tokens")),
            ("myvllm flash", ours, ""),
            ("torch SDPA", lambda: dense(F.scaled_dot_product_attention(
                qd, kd, vd, attn_mask=causal_mask(seq, ctx), scale=scale)) if prefix else
                dense(F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=scale)),
             ""),
        ]  # fmt: skip
        rows = []
        for label, fn, skip in impls:
            if skip:
                rows.append((label, skip))
                continue
            out = fn()
            err = (out.float() - ref).abs().max().item()
            ok = bool(err <= TOL[dtype]) and not math.isnan(err)
            if not ok:
                all_ok = False
                rows.append((label, "NO", err))
                continue
            ms = bench_ms(fn, device, args.cuda_graph)
            rows.append((label, "OK", err, ms, flops / ms / 1e9, peak_extra_mb(fn, device)))
        sdpa_ms = next((r[3] for r in rows if r[0] == "torch SDPA" and len(r) > 3), None)
        for r in rows:
            if len(r) == 2:
                print(f"{seq:>7}  {r[0]:<18} {'-':<7} {r[1]}")
            elif len(r) == 3:
                print(f"{seq:>7}  {r[0]:<18} {'NO':<7} {r[2]:>9.2e}  (wrong: not timed)")
            else:
                _, _, err, ms, tflops, peak = r
                peak_s = f"{peak:9.1f}" if peak is not None else f"{'-':>9}"
                ratio = f"{sdpa_ms / ms:7.2f}" if sdpa_ms else f"{'-':>7}"
                print(f"{seq:>7}  {r[0]:<18} {'OK':<7} {err:>9.2e} {ms:>9.3f} {tflops:>8.1f} "
                      f"{peak_s} {ratio}")
        if gpu and seq == seq_lens[-1]:
            print(f"# torch SDPA ran: {', '.join(cuda_kernel_names(impls[-1][1]))}")
        del q, k, v, k_all, v_all, paged, qd, kd, vd, ref
        if gpu:
            torch.cuda.empty_cache()

    if args.sweep and gpu:
        sweep(seq_lens[-1], batch, hq, hkv, d, dtype, device, PrefillConfig,
              flash_attention_varlen_triton)  # fmt: skip
    if not all_ok:
        raise SystemExit("some implementation is wrong (NO above)")


def causal_mask(seq: int, ctx: int):
    """Query row i (of the last seq of ctx positions) sees keys 0 .. ctx - seq + i."""
    from torch.nn.attention.bias import causal_lower_right

    return causal_lower_right(seq, ctx)


def paged_cache(k_all: torch.Tensor, v_all: torch.Tensor, batch: int, ctx: int,
                gen: torch.Generator, block_size: int = 16
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """K/V of `batch` contexts of `ctx` tokens written into a paged cache of `block_size`-token
    blocks handed out in a shuffled order: (k_cache, v_cache, block_tables)."""
    blocks_per_seq = -(-ctx // block_size)
    num_blocks = batch * blocks_per_seq
    _, hkv, d = k_all.shape
    order = torch.randperm(num_blocks, generator=gen).to(k_all.device)
    block_tables = order.view(batch, blocks_per_seq).to(torch.int32)
    k_cache = torch.zeros(num_blocks, block_size, hkv, d, dtype=k_all.dtype, device=k_all.device)
    v_cache = torch.zeros_like(k_cache)
    pos = torch.arange(ctx, device=k_all.device)
    for b in range(batch):
        blocks = block_tables[b].long()[pos // block_size]
        k_cache[blocks, pos % block_size] = k_all[b * ctx:(b + 1) * ctx]
        v_cache[blocks, pos % block_size] = v_all[b * ctx:(b + 1) * ctx]
    return k_cache, v_cache, block_tables


def cuda_kernel_names(fn: Callable[[], object]) -> list[str]:
    """The GPU kernels one call launches (shows which backend SDPA picked), names shortened."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = {e.name for e in prof.events() if e.device_type.name == "CUDA"}
    return sorted(name[:90] for name in names)


def sdpa_oracle(qd: torch.Tensor, kd: torch.Tensor, vd: torch.Tensor, scale: float
                ) -> torch.Tensor:  # fmt: skip
    """Causal attention on [B, H, S, D] queries over [B, H, ctx, D] keys (the queries are the
    last S positions) in float32, or in float64 for float32 inputs (an fp32 row, SDPA's
    included, must be checked against something more precise than itself). The mask is an
    explicit boolean matrix, independent of the lower-right mask object the timed row uses."""
    wide = torch.float64 if qd.dtype == torch.float32 else torch.float32
    seq, ctx = qd.shape[2], kd.shape[2]
    rows = torch.arange(seq, device=qd.device)[:, None] + (ctx - seq)
    visible = torch.arange(ctx, device=qd.device)[None, :] <= rows
    out = torch.nn.functional.scaled_dot_product_attention(
        qd.to(wide), kd.to(wide), vd.to(wide), attn_mask=visible, scale=scale)  # fmt: skip
    return out.float()


def sweep(seq: int, batch: int, hq: int, hkv: int, d: int, dtype: torch.dtype,
          device: torch.device, config_cls, kernel) -> None:  # fmt: skip
    """Time our kernel over a small grid of tile configurations at one shape."""
    import itertools

    n = batch * seq
    q = torch.randn(n, hq, d, device=device, dtype=dtype)
    k = torch.randn(n, hkv, d, device=device, dtype=dtype)
    v = torch.randn(n, hkv, d, device=device, dtype=dtype)
    cu = torch.arange(0, n + 1, seq, dtype=torch.int32, device=device)
    flops = batch * 4 * (seq * seq / 2) * d * hq
    print(f"# sweep at seq_len {seq}: block_m block_n warps stages tma -> ms TFLOP/s max_err")
    group = hq // hkv
    qd = q.view(batch, seq, hq, d).transpose(1, 2)
    kd = k.view(batch, seq, hkv, d).transpose(1, 2).repeat_interleave(group, 1)
    vd = v.view(batch, seq, hkv, d).transpose(1, 2).repeat_interleave(group, 1)
    ref = sdpa_oracle(qd, kd, vd, d**-0.5).transpose(1, 2).reshape(n, hq, d)
    del qd, kd, vd
    grid = itertools.product([64, 128], [64, 128], [4, 8], [2, 3], [False, True])
    for bm, bn, warps, stages, tma in grid:
        cfg = config_cls(block_m=bm, block_n=bn, num_warps=warps, num_stages=stages, use_tma=tma)
        line = f"  {bm:4d} {bn:4d} {warps:2d} {stages:2d} {int(tma):2d}"
        try:
            fn = lambda: kernel(q, k, v, cu, cu, seq, seq, d**-0.5, config=cfg)  # noqa: E731
            err = (fn().float() - ref).abs().max().item()
            ms = bench_ms(fn, device)
            print(f"{line}  {ms:8.3f} {flops / ms / 1e9:7.1f} {err:9.2e}")
        except Exception as exc:  # out of shared memory etc.: report and continue the sweep
            print(f"{line}  failed: {type(exc).__name__}: {str(exc)[:80]}")


if __name__ == "__main__":
    main()
