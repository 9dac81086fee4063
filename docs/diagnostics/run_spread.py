"""Why one run of the bench workload can take a few percent longer than its neighbours in the
same process (GPU only).

Run from the repository root: python3 docs/diagnostics/run_spread.py [RUNS] [--freeze]

One engine (Qwen3-0.6B shape, random weights, the defaults), then RUNS timed runs of the bench
workload (256 sequences, 100..1024 in and out, seed 0), each on prompts the prefix cache has
not seen. For every run: output tok/s; Python's garbage-collector pauses in it (gc.callbacks:
count and total per generation, the longest one); and its three longest calls of
LLMEngine.step(), the host's view of a step (with asynchronous scheduling it returns once
the next step is launched, so a long call is time the GPU may have waited on the host).
--freeze calls gc.freeze() after the engine is built: everything that exists then (the model,
the block table, ~70,000 blocks) moves to a generation the collector never walks again.
"""
import gc
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "src"))
from benchmarks.workload import QWEN3_CONFIG, fresh_copy, make_workload  # noqa: E402

from myvllm import LLM, SamplingParams  # noqa: E402
from myvllm.engine.llm_engine import LLMEngine  # noqa: E402

runs = int(next((a for a in sys.argv[1:] if a.isdigit()), "10"))
freeze = "--freeze" in sys.argv

llm = LLM(str(QWEN3_CONFIG.parent), load_format="dummy", max_model_length=2048)
prompts, max_tokens = make_workload(256, 100, 1024, 1024, min(llm.vocab_size, 10000))
params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in max_tokens]
llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
if freeze:
    gc.freeze()
print(f"gc thresholds {gc.get_threshold()}, frozen objects {gc.get_freeze_count():,}, "
      f"tracked objects {len(gc.get_objects()):,}")

pauses: list[tuple[int, float]] = []  # (generation, seconds) of each collection in this run
started: list[float] = []


def on_gc(phase: str, info: dict) -> None:
    if phase == "start":
        started.append(time.perf_counter())
    elif started:
        pauses.append((info["generation"], time.perf_counter() - started.pop()))


step_times: list[float] = []
original_step = LLMEngine.step


def timed_step(self):
    start = time.perf_counter()
    out = original_step(self)
    step_times.append(time.perf_counter() - start)
    return out


gc.callbacks.append(on_gc)
LLMEngine.step = timed_step
rates = []
for key in range(1, runs + 1):
    pauses.clear()
    step_times.clear()
    start = time.perf_counter()
    llm.generate(fresh_copy(prompts, key=key), params, use_tqdm=False)
    rates.append(sum(max_tokens) / (time.perf_counter() - start))
    per_gen = {g: [d for gg, d in pauses if gg == g] for g in (0, 1, 2)}
    gcs = ", ".join(f"gen{g} {len(d)}x {sum(d) * 1e3:.1f} ms" for g, d in per_gen.items())
    longest_gc = max((d for _, d in pauses), default=0.0)
    slow = sorted(step_times, reverse=True)[:3]
    print(f"run {key:2d}: {rates[-1]:,.0f} tok/s | gc: {gcs}, longest {longest_gc * 1e3:.1f} ms"
          f" | {len(step_times)} steps, median {statistics.median(step_times) * 1e3:.2f} ms, "
          f"longest {', '.join(f'{t * 1e3:.1f}' for t in slow)} ms", flush=True)
ranked = sorted(rates)
print(f"{runs} runs{' (gc frozen)' if freeze else ''}: median {statistics.median(ranked):,.0f}, "
      f"min {ranked[0]:,.0f}, max {ranked[-1]:,.0f} output tok/s")
