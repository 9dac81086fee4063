"""Kernel times of decode steps with a bf16 KV cache against an fp8 one (GPU only).

Run from the repository root: python3 docs/diagnostics/profile_fp8_decode.py

For each cache dtype: one engine (Qwen3-0.6B shape, random weights, a fixed cache of 40,000
blocks), 256 prompts of 1,000 random tokens with 48 tokens each to generate; the prompts'
prefills run first, then 5 decode steps, then 20 timed steps (the mean step time and how many
rows they had), then 10 steps under torch.profiler, whose CUDA kernels are written to
$OUT/fp8prof_{auto,fp8}.txt (sorted by GPU time). The decode attention kernel's time per call
is the figure to compare: the fp8 kernel reads half the bytes and converts every element.
"""
import os
import random
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, "src")
from myvllm import LLM, SamplingParams  # noqa: E402

out = os.environ.get("OUT", "/tmp")
for dtype in ("auto", "fp8"):
    llm = LLM("configs/Qwen3-0.6B", load_format="dummy", kv_cache_dtype=dtype,
              num_kvcache_blocks=40000, max_model_length=2048)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 150000) for _ in range(1000)] for _ in range(256)]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    llm.generate(prompts[:8], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    for prompt in prompts:
        llm.add_request(prompt, params)
    for _ in range(400):  # past the prefills
        if not llm.scheduler.waiting and all(s.num_computed_tokens >= 1000
                                             for s in llm.scheduler.running):
            break
        llm.step()
    for _ in range(5):
        llm.step()
    rows = len(llm.scheduler.running)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(20):
        llm.step()
    torch.cuda.synchronize()
    print(f"{dtype}: decode step {1000 * (time.perf_counter() - start) / 20:.3f} ms, "
          f"{rows} rows running", flush=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            llm.step()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25)
    with open(f"{out}/fp8prof_{dtype}.txt", "w") as f:
        f.write(table)
    while not llm.is_finished():
        llm.step()
    del llm
    torch.cuda.empty_cache()
