"""Where the time to first token of a lone long prompt goes (GPU only).

Run from the repository root: python3 docs/diagnostics/long_prompt_ttft.py [BUDGETS]
(comma-separated max_num_batched_tokens values, default 16384,32768).

A 1k-token prompt alone gets its first token in ~6 ms on the H200 (a chunk CUDA graph), a
4k-token one in ~60 ms, although its FLOPs are only four times as many. For each budget, one
engine (Qwen3-0.6B shape, random weights, the other settings default): the time to first token
of prompts of 1k-32k tokens (median of three new prompts after one to warm up), with the
caching allocator's counters over those runs (a cudaMalloc or a retry after freeing cached
memory would show there); then one 4k prompt with each step's host phases timed (schedule;
run() until it returns; the wait for the device; reading back), and under torch.profiler by
device time and by host time.
"""
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from admission_step import PHASES, timed  # noqa: E402  (same folder)
from benchmarks.workload import QWEN3_CONFIG, build_random_checkpoint  # noqa: E402
from myvllm import LLM, SamplingParams  # noqa: E402

VOCAB = 100_000
LENGTHS = (1024, 2048, 2049, 4096, 8192, 16384, 32000)
ONE = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
ALLOCATOR_COUNTERS = ("num_device_alloc", "num_device_free", "num_alloc_retries")


def prompt(n: int, salt: int) -> list[int]:
    """A prompt that shares no prefix with another (n, salt). (The first version of this
    script left n out: each length's prompts began with those of the length before, and the
    prefix hits were what showed the free list's cost, docs/benchmarks.md.)"""
    return [(7919 * salt + 31 * j + 13 * n + 1) % VOCAB for j in range(n)]


def ttft(llm: LLM, n: int) -> None:
    llm.generate([prompt(n, 0)], ONE, use_tqdm=False)
    before = torch.cuda.memory_stats()
    times = []
    for salt in (1, 2, 3):  # a new prompt each time: no prefix-cache hit
        torch.cuda.synchronize()
        start = time.perf_counter()
        llm.generate([prompt(n, salt)], ONE, use_tqdm=False)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    after = torch.cuda.memory_stats()
    counters = ", ".join(f"{name} +{after.get(name, 0) - before.get(name, 0)}"
                         for name in ALLOCATOR_COUNTERS)
    print(f"  {n:6d} tokens: {statistics.median(times):7.1f} ms "
          f"({' '.join(f'{t:.1f}' for t in times)}); {counters}", flush=True)


def phases(llm: LLM, n: int) -> None:
    llm.add_request(prompt(n, 4), ONE)
    step = 0
    while not llm.is_finished():
        PHASES.clear()
        torch.cuda.synchronize()
        start = time.perf_counter()
        llm.step()
        torch.cuda.synchronize()
        total = (time.perf_counter() - start) * 1e3
        print(f"  step {step}: {total:.2f} ms: "
              + ", ".join(f"{k} {v:.2f}" for k, v in PHASES.items()), flush=True)
        step += 1


def profiled(llm: LLM, n: int) -> None:
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate([prompt(n, 5)], ONE, use_tqdm=False)
        torch.cuda.synchronize()
    averages = prof.key_averages()
    print(averages.table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=60))
    print(averages.table(sort_by="self_cpu_time_total", row_limit=15,
                         max_name_column_width=60), flush=True)


def main() -> None:
    budgets = [int(b) for b in sys.argv[1].split(",")] if len(sys.argv) > 1 else [16384, 32768]
    with tempfile.TemporaryDirectory() as tmp:
        path = build_random_checkpoint(QWEN3_CONFIG, Path(tmp), "cuda", False)
        for budget in budgets:
            llm = LLM(str(path), max_num_batched_tokens=budget)
            print(f"max_num_batched_tokens={budget}: time to first token alone", flush=True)
            for n in LENGTHS:
                ttft(llm, n)
            sched, runner = llm.scheduler, llm.model_runner
            sched.schedule = timed("schedule", sched.schedule)
            runner.run = timed("run (host)", runner.run, split_device_wait=True)
            llm.engine_core._read_back = timed("read back", llm.engine_core._read_back)
            print("4096 tokens, step by step (each phase drained):", flush=True)
            phases(llm, 4096)
            if budget == budgets[0]:
                profiled(llm, 4096)
            llm.exit()
            del llm, sched, runner
            gc.collect()  # the timed() wrappers make reference cycles
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
