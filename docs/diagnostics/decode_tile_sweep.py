"""The decode attention kernel alone, bf16 cache against fp8, over its tile knobs (GPU only).

Run from the repository root: python3 docs/diagnostics/decode_tile_sweep.py

Qwen3-0.6B's attention shape (16 query heads, 8 kv heads, head_dim 128, 16-token blocks laid
out in a random order, as a busy cache holds them). For each batch, context and cache dtype:
the time of one call with the shipped tiles (decode_config) and with every tile of a small
sweep, and the bytes of K and V it reads per second against the copy bandwidth measured here.
The question it answers: whether the fp8 cache's kernel is bound by the bytes it reads (then
it takes half the time of bf16's) or by something else (then the tile sweep says what).
"""
import itertools
import sys

sys.path.insert(0, "src")
import torch  # noqa: E402
import triton  # noqa: E402

from myvllm.kernels.decode_attention import (  # noqa: E402
    DecodeConfig,
    decode_config,
    paged_attention_decode_triton,
)

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 16, 8, 128, 16
CASES = [(256, 512), (256, 1024), (128, 1024), (64, 2048), (32, 1024), (1, 4096)]
SWEEP = [DecodeConfig(n, w, s) for n, w, s in itertools.product((32, 64, 128), (2, 4, 8), (2, 3, 4))]


def copy_bandwidth() -> float:
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = triton.testing.do_bench(lambda: y.copy_(x), warmup=5, rep=50)
    return 2 * x.numel() / (ms * 1e-3)


def case(batch: int, context: int, cache_dtype: torch.dtype, bandwidth: float) -> None:
    blocks_per_seq = context // BLOCK
    num_blocks = batch * blocks_per_seq
    gen = torch.Generator(device="cuda").manual_seed(0)
    k = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, device="cuda", generator=gen)
    v = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, device="cuda", generator=gen)
    k_cache, v_cache = k.to(cache_dtype), v.to(cache_dtype)
    del k, v
    tables = torch.randperm(num_blocks, device="cuda", generator=gen).view(batch, blocks_per_seq)
    tables = tables.to(torch.int32)
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
    read = 2 * batch * context * KV_HEADS * HEAD_DIM * k_cache.element_size()

    def run(cfg: DecodeConfig | None) -> float:
        fn = lambda: paged_attention_decode_triton(q, k_cache, v_cache, tables, lens,  # noqa: E731
                                                   HEAD_DIM ** -0.5, config=cfg)
        return triton.testing.do_bench(fn, warmup=10, rep=60)

    shipped = decode_config(q.device, HEAD_DIM, cache_dtype)
    base = run(None)
    timed = []
    for cfg in SWEEP:
        try:
            timed.append((run(cfg), cfg))
        except Exception as error:  # a tile that does not fit in shared memory: report it
            print(f"    {cfg}: {type(error).__name__}", flush=True)
    best_ms, best = min(timed, key=lambda t: t[0])
    name = "fp8 " if cache_dtype == torch.float8_e4m3fn else "bf16"
    print(f"batch {batch:3d} ctx {context:5d} {name}: shipped {shipped.block_n}/{shipped.num_warps}/"
          f"{shipped.num_stages} {1e3 * base:8.1f} us {read / (base * 1e-3) / 1e12:5.2f} TB/s "
          f"({100 * read / (base * 1e-3) / bandwidth:3.0f}% of copy) | best "
          f"{best.block_n}/{best.num_warps}/{best.num_stages} {1e3 * best_ms:8.1f} us "
          f"{read / (best_ms * 1e-3) / 1e12:5.2f} TB/s", flush=True)
    top = sorted(timed, key=lambda t: t[0])[:4]
    print("    fastest: " + ", ".join(f"{c.block_n}/{c.num_warps}/{c.num_stages} {1e3 * t:.1f}"
                                       for t, c in top), flush=True)


def main() -> None:
    bandwidth = copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s; tiles as block_n/num_warps/num_stages")
    for batch, context in CASES:
        for dtype in (torch.bfloat16, torch.float8_e4m3fn):
            case(batch, context, dtype, bandwidth)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
