"""Batch-1 decode: ms a token and GPU kernels a step, with the decode-step fusions and without
(GPU only).

Run from the repository root: PYTHONPATH=src python3 docs/diagnostics/decode_launches.py

The fusions compared (each one the unfused version computes in two kernels):

    store   RoPE (and Qwen3's q/k norms) with the KV store: fused_ops.norm_rope_store_kvcache,
            the ("rotary_emb", "attn") pair of layers/fused.py's FUSED_PAIRS

"unfused" builds the engine with that pair removed from FUSED_PAIRS. For each: one engine
(Qwen3-0.6B shape, dummy weights, CUDA graphs, a fixed cache), then the batch-1 figure of
benchmark_tps.py (a 128-token prompt: the time of 129 greedy tokens less that of 1, over 128;
the median of 5), then 20 decode steps at batch 1 under torch.profiler: the GPU kernels a
step (the CUDA graph's kernels are recorded one by one) and the kernels by name.
"""
import argparse
import random
import sys
from collections import Counter

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, "src")
import myvllm.layers.fused as fused  # noqa: E402
from myvllm import LLM, SamplingParams  # noqa: E402

sys.path.insert(0, ".")
from benchmarks.workload import batch1_ms_per_token  # noqa: E402

STORE_PAIR = ("rotary_emb", "attn")
PROFILED_STEPS = 20


def kernels_per_step(llm: LLM, prompt: list[int]) -> tuple[float, Counter[str]]:
    llm.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=PROFILED_STEPS + 16,
                                           ignore_eos=True))  # fmt: skip
    for _ in range(4):  # the prefill and a few decode steps outside the profile
        llm.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILED_STEPS):
            llm.step()
        torch.cuda.synchronize()
    while not llm.is_finished():
        llm.step()
    names = Counter(e.name for e in prof.events() if e.device_type == DeviceType.CUDA)
    return sum(names.values()) / PROFILED_STEPS, names


def run(variant: str, prompt: list[int]) -> None:
    saved = fused.FUSED_PAIRS
    if variant == "unfused":
        fused.FUSED_PAIRS = tuple(p for p in saved if p != STORE_PAIR)
    try:
        llm = LLM("configs/Qwen3-0.6B", load_format="dummy", num_kvcache_blocks=4096,
                  max_model_length=1024, max_num_sequences=16)
    finally:
        fused.FUSED_PAIRS = saved
    median, low, high = batch1_ms_per_token(llm, prompt)
    per_step, names = kernels_per_step(llm, prompt)
    print(f"{variant:8s} batch-1 decode: {median:.3f} ms/token (median of 5, range "
          f"{low:.3f}-{high:.3f}); {per_step:.1f} GPU kernels a step", flush=True)
    for name, count in names.most_common(12):
        print(f"    {count / PROFILED_STEPS:6.1f} a step  {name[:100]}")
    llm.exit()
    del llm
    torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default="unfused,fused",
                        help="comma-separated, of: unfused, fused (default both, in that order)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("decode_launches.py needs a CUDA GPU")
    rng = random.Random(0)
    prompt = [rng.randrange(100, 150000) for _ in range(128)]
    for variant in args.variants.split(","):
        if variant not in ("unfused", "fused"):
            parser.error(f"unknown variant {variant!r}: unfused or fused")
        run(variant, prompt)


if __name__ == "__main__":
    main()
