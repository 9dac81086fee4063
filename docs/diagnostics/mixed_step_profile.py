"""Where a chunked-prefill step's time goes, on the stall scenario (GPU only).

Run from the repository root: python3 docs/diagnostics/mixed_step_profile.py [BUDGETS]
(comma-separated max_num_batched_tokens values, default 2048). For each budget: 64 sequences
decode, a 16,000-token prompt joins; every step's wall time until its first token, then
torch.profiler's kernel table over two later mixed steps; with the first budget, the time to
first token of 1k, 4k and 32k-token prompts alone. First, the prefill kernel alone: contiguous
and paged K/V, small chunks after long prefixes, torch SDPA for scale, and a tile-map launch
(a chunk beside 64 decode rows) at two query-tile heights.

The logs docs/raw/2026-11-30e-h200-mixed-step-profile-eager.log (before chunked steps had
graphs) and -graphs.log (after) came from this script; the first also holds cProfile tables
that this version leaves out.
"""
import itertools
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "src"))
import torch  # noqa: E402
import triton.testing as tt  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from benchmarks.workload import QWEN3_CONFIG, build_random_checkpoint  # noqa: E402
from myvllm import LLM, SamplingParams  # noqa: E402
from myvllm.kernels.prefill_attention import (  # noqa: E402
    PrefillConfig,
    flash_attention_varlen_triton,
)
from myvllm.kernels.tile_map import TileMap, build_tile_map  # noqa: E402

VOCAB = 10_000
H, KVH, D, PAGE = 16, 8, 128, 16  # Qwen3-0.6B's attention, blocks of 16 tokens


def sync() -> None:
    torch.cuda.synchronize()


def kernel_bench() -> None:
    dev, dt = torch.device("cuda"), torch.bfloat16

    def case(q_len: int, k_len: int, paged: bool) -> None:
        q = torch.randn(q_len, H, D, device=dev, dtype=dt)
        cu_q = torch.tensor([0, q_len], device=dev, dtype=torch.int32)
        cu_k = torch.tensor([0, k_len], device=dev, dtype=torch.int32)
        if paged:
            nb = -(-k_len // PAGE)
            kc = torch.randn(nb, PAGE, KVH, D, device=dev, dtype=dt)
            vc = torch.randn_like(kc)
            bt = torch.randperm(nb, device=dev, dtype=torch.int32)[None]
            fn = lambda: flash_attention_varlen_triton(  # noqa: E731
                q, q, q, cu_q, cu_k, q_len, k_len, D**-0.5, bt, kc, vc)
        else:
            k = torch.randn(k_len, KVH, D, device=dev, dtype=dt)
            v = torch.randn_like(k)
            fn = lambda: flash_attention_varlen_triton(  # noqa: E731
                q, k, v, cu_q, cu_k, q_len, k_len, D**-0.5)
        ms = tt.do_bench(fn, warmup=5, rep=40)
        flops = 4 * H * D * (q_len * (k_len - q_len) + q_len * (q_len + 1) / 2)
        print(f"prefill kernel q={q_len:>6} k={k_len:>6} paged={paged}: {ms:.3f} ms, "
              f"{flops / ms / 1e9:.0f} TFLOP/s", flush=True)

    # A 448-token chunk after 16k tokens beside 64 decode rows, launched from a tile map
    # (every row gets a tile here, no splits), at query tiles of 128 and 64 rows.
    lq, lk = [448] + [1] * 64, [16000] + [900] * 64
    q = torch.randn(sum(lq), H, D, device=dev, dtype=dt)
    cu_q = torch.tensor([0, *itertools.accumulate(lq)], device=dev, dtype=torch.int32)
    cu_k = torch.tensor([0, *itertools.accumulate(lk)], device=dev, dtype=torch.int32)
    nb = 1000 + 64 * 57
    kc = torch.randn(nb, PAGE, KVH, D, device=dev, dtype=dt)
    vc = torch.randn_like(kc)
    bt = torch.arange(65 * 1000, device=dev, dtype=torch.int32).view(65, 1000) % nb
    for bm in (128, 64):
        cfg = PrefillConfig(block_m=bm, block_n=128 if bm == 128 else 64,
                            num_warps=8 if bm == 128 else 4, num_stages=3)
        rows, combine = build_tile_map(lq, lk, bm, cfg.block_n, 80, 0)
        tiles = TileMap(torch.tensor(rows, device=dev, dtype=torch.int32).view(-1, 5),
                        torch.tensor(combine or [-1, 0, 0, 0], device=dev,
                                     dtype=torch.int32).view(-1, 4), 0)
        ms = tt.do_bench(lambda: flash_attention_varlen_triton(  # noqa: B023
            q, q, q, cu_q, cu_k, 0, 0, D**-0.5, bt, kc, vc, tiles, config=cfg), rep=40)
        print(f"tile map, 448-token chunk at 16k + 64 decode rows, block_m {bm}: {ms:.3f} ms",
              flush=True)
    for q_len, k_len, paged in [(16384, 16384, False), (16384, 16384, True),
                                (16384, 32768, True), (2048, 16000, True), (448, 16000, True),
                                (4096, 4096, False), (1024, 1024, False)]:
        case(q_len, k_len, paged)
    qs = torch.randn(1, H, 16384, D, device=dev, dtype=dt)
    ms = tt.do_bench(lambda: torch.nn.functional.scaled_dot_product_attention(
        qs, qs, qs, is_causal=True), rep=40)
    print(f"SDPA causal 16k: {ms:.3f} ms, {4 * H * D * 16384 * 16385 / 2 / ms / 1e9:.0f} "
          "TFLOP/s", flush=True)


def start_decoders(llm: LLM, salt: int) -> list[int]:
    # Decode until aborted: as many tokens as the context leaves (more would be refused).
    sp = SamplingParams(temperature=0.0, max_tokens=llm.max_model_length - 128, ignore_eos=True)
    ids = [llm.add_request([(7 * i + j + salt) % VOCAB for j in range(128)], sp)
           for i in range(64)]
    started: set[int] = set()
    while len(started) < len(ids):
        outs, _ = llm.step_outputs()
        started.update(o.request_id for o in outs)
    for _ in range(5):
        llm.step()
    return ids


def stop(llm: LLM, ids: list[int]) -> None:
    for request_id in ids:
        llm.abort(request_id)
    while not llm.is_finished():
        llm.step()


def scenario(llm: LLM, label: str, salt: int = 1) -> None:
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    ids = start_decoders(llm, salt)
    before = []
    for _ in range(20):
        sync()
        t = time.perf_counter()
        llm.step()
        sync()
        before.append((time.perf_counter() - t) * 1e3)
    long_id = llm.add_request([(3 * j + salt * 13 + 1) % VOCAB for j in range(16_000)], one)
    after, done = [], False
    while not done:
        sync()
        t = time.perf_counter()
        outs, _ = llm.step_outputs()
        sync()
        after.append((time.perf_counter() - t) * 1e3)
        done = any(o.request_id == long_id for o in outs)
    print(f"[{label}] median decode {statistics.median(before):.2f} ms; steps after join: "
          + " ".join(f"{x:.1f}" for x in after), flush=True)
    stop(llm, ids)
    ids = start_decoders(llm, salt + 100)
    llm.add_request([(5 * j + salt * 17 + 3) % VOCAB for j in range(16_000)], one)
    for _ in range(12):  # on to a late chunk (a long context)
        llm.step_outputs()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.step_outputs()
        llm.step_outputs()
        sync()
    print(f"[{label}] torch profiler, 2 steps, by device time:\n" + prof.key_averages().table(
        sort_by="cuda_time_total", row_limit=14, max_name_column_width=60), flush=True)
    stop(llm, ids)


def ttft(llm: LLM, n: int) -> None:
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    llm.generate([[(11 * 99 + 5 * j) % VOCAB for j in range(n)]], one, use_tqdm=False)
    times = []
    for r in range(5):
        prompt = [(11 * r + 5 * j + 1) % VOCAB for j in range(n)]
        sync()
        t = time.perf_counter()
        llm.generate([prompt], one, use_tqdm=False)
        sync()
        times.append((time.perf_counter() - t) * 1e3)
    print(f"TTFT {n}: median {statistics.median(times):.1f} ms "
          f"({' '.join(f'{x:.1f}' for x in times)})", flush=True)


if __name__ == "__main__":
    kernel_bench()
    budgets = [int(b) for b in sys.argv[1].split(",")] if len(sys.argv) > 1 else [2048]
    with tempfile.TemporaryDirectory() as tmp:
        path = build_random_checkpoint(QWEN3_CONFIG, Path(tmp), "cuda", False)
        for budget in budgets:
            engine = LLM(str(path), max_num_batched_tokens=budget)
            scenario(engine, f"budget {budget}")
            if budget == budgets[0]:
                for length in (1024, 4096, 32000):
                    ttft(engine, length)
            engine.exit()
            del engine
            torch.cuda.empty_cache()
