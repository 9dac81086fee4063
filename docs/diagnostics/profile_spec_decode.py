"""Where an n-gram speculation step's time goes (GPU only; the bundled SmolLM2).

Run from the repository root: BATCH=1 python3 docs/diagnostics/profile_spec_decode.py

One engine with n-gram speculation (k = 4, lookup 2..4) on BATCH copies of the copy-heavy
prompts of benchmarks/benchmark_spec_decode.py, 128 greedy tokens each: a warm-up run, a
timed run (ms per engine step and how many steps), then the same run under cProfile (the
host's Python, written to $OUT/b{BATCH}_cprofile_spec.txt by cumulative and _tottime.txt by
own time) and under torch.profiler (CPU ops and CUDA kernels:
$OUT/b{BATCH}_torchprof_spec_{cpu,cuda}.txt).
"""
import cProfile
import io
import os
import pstats
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, "src")
sys.path.insert(0, ".")
from benchmarks.benchmark_spec_decode import COPY_PROMPTS  # noqa: E402
from myvllm import LLM, SamplingParams  # noqa: E402

out = os.environ.get("OUT", "/tmp")
batch = int(os.environ.get("BATCH", "1"))
llm = LLM(None, num_kvcache_blocks=4096, max_model_length=2048, speculative_method="ngram",
          num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=4)
params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
prompts: list[str | list[int]] = [COPY_PROMPTS[i % 2] for i in range(batch)]
llm.generate(prompts, params, use_tqdm=False)
torch.cuda.synchronize()
steps = [0]
step = llm.engine_core.step


def counted_step():  # type: ignore[no-untyped-def]
    steps[0] += 1
    return step()


llm.engine_core.step = counted_step  # type: ignore[method-assign]
start = time.perf_counter()
llm.generate(prompts, params, use_tqdm=False)
torch.cuda.synchronize()
elapsed_ms = 1000 * (time.perf_counter() - start)
print(f"batch {batch}: {elapsed_ms:.1f} ms for 128 tokens, {steps[0]} steps, "
      f"{elapsed_ms / steps[0]:.3f} ms a step", flush=True)
profiler = cProfile.Profile()
profiler.enable()
llm.generate(prompts, params, use_tqdm=False)
torch.cuda.synchronize()
profiler.disable()
for order, suffix in (("cumulative", ""), ("tottime", "_tottime")):
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats(order).print_stats(45)
    with open(f"{out}/b{batch}_cprofile_spec{suffix}.txt", "w") as f:
        f.write(text.getvalue())
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
for order, name in (("self_cpu_time_total", "cpu"), ("self_cuda_time_total", "cuda")):
    with open(f"{out}/b{batch}_torchprof_spec_{name}.txt", "w") as f:
        f.write(prof.key_averages().table(sort_by=order, row_limit=50))
