"""Speculative decoding (n-gram prompt lookup, or a draft model) against plain decoding: ms
per output token.

    uv run python benchmarks/benchmark_spec_decode.py --quick   # tiny CPU: correctness, counts
    python benchmarks/benchmark_spec_decode.py                  # on a GPU: the bundled SmolLM2
    python benchmarks/benchmark_spec_decode.py --method draft   # a draft model proposes
                                                # (default: the target itself, which measures
                                                # the mechanism, not a speed-up)
    python benchmarks/benchmark_spec_decode.py --profile        # and where a verification
                                                # step's time goes (torch.profiler)

Two workloads, greedy, ignore_eos, each at every batch size (--batch-sizes, default 1,16):

    copy   the model is asked to repeat a given text (a passage and a code listing): its
           output copies its prompt, and prompt lookup's proposals are mostly accepted
    free   open-ended prompts: little to copy, few proposals; speculation should cost
           next to nothing there

Prints, for each, whether the speculative run's tokens equal the plain run's (greedy:
they must, up to bf16 ties on a GPU: the verification forward computes a token's logits in
a chunk of k+1 rows, the plain one in a row alone), the acceptance rate and mean accepted
length, then ms per output token with and without speculation and the speed-up.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

PASSAGE = (
    "The PagedAttention algorithm stores the key and value vectors of each sequence in "
    "fixed-size blocks that need not be contiguous in memory. A block table maps each "
    "sequence's logical blocks to physical ones, so memory is allocated on demand and "
    "shared between sequences with a common prefix. Continuous batching adds new requests "
    "to the running batch as soon as others finish, instead of waiting for a whole batch. "
    "Together they keep the GPU busy and its memory nearly full of useful state.")
CODE = '''def merge_sorted(left, right):
    result = []
    i = j = 0
    while i < len(left) and j < len(right):
        if left[i] <= right[j]:
            result.append(left[i])
            i += 1
        else:
            result.append(right[j])
            j += 1
    result.extend(left[i:])
    result.extend(right[j:])
    return result
'''
COPY_PROMPTS = [
    f"Repeat the following text exactly, word for word.\n\nText:\n{PASSAGE}\n\nRepeated text:\n",
    "Rewrite this Python function with a docstring added, keeping the code the same.\n\n"
    f"{CODE}\nRewritten function:\n",
]
FREE_PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain to a child why the sky is blue.",
]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny CPU run (tiny random model)")
    parser.add_argument("--model", default=None, help="default: the bundled SmolLM2 GGUF")
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--k", type=int, default=8,
                        help="num_speculative_tokens (8: the fastest of 4 and 8 on the H200 "
                             "at batch 1 and 16, copy-heavy and free)")
    parser.add_argument("--lookup-min", type=int, default=2)
    parser.add_argument("--lookup-max", type=int, default=4)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--method", choices=("ngram", "draft"), default="ngram",
                        help="speculative_method")
    parser.add_argument("--draft-model", default=None,
                        help="--method draft: speculative_model (default: the target itself)")
    parser.add_argument("--profile", action="store_true",
                        help="after the table: torch.profiler over one speculative copy run "
                        "at batch 1; per engine step the launches, copies and host waits, "
                        "and the ops with the most host time")
    return parser.parse_args()


if __name__ == "__main__":
    parse_args()  # --help and bad arguments answer here, before torch's import

sys.path.insert(0, str(REPO / "src"))  # run from a checkout without installing

from myvllm import LLM, SamplingParams  # noqa: E402


def time_run(llm: LLM, prompts: list[str | list[int]], params: SamplingParams
             ) -> tuple[list[list[int]], float]:
    """(tokens, ms per output token of one sequence) of generate(), after a warm-up run."""
    import torch

    llm.generate(prompts, params, use_tqdm=False)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    tokens = [out["token_ids"] for out in outs]
    # Each sequence of the batch gets its tokens in the same wall time: per-token latency.
    return tokens, 1000.0 * elapsed / max(len(t) for t in tokens)


def main() -> None:
    args = parse_args()
    settings: dict[str, object] = dict(enforce_eager=args.enforce_eager)
    model = args.model
    if args.quick:
        sys.path.insert(0, str(REPO / "tests"))
        from helpers_models import tiny_checkpoint

        model = str(tiny_checkpoint("qwen3"))
        settings.update(max_model_length=256, num_kvcache_blocks=256)
        args.max_tokens, args.batch_sizes = 32, "1,4"
        copy: list[str | list[int]] = [[5, 6, 7, 8, 9, 10, 11] * 8]
        free: list[str | list[int]] = [[3, 141, 59, 26, 53, 58, 97, 93, 23, 84]]
    else:
        copy, free = list(COPY_PROMPTS), list(FREE_PROMPTS)
        # Two engines live side by side: each gets a fixed cache (16 sequences of up to
        # 1,024 tokens fit 16 times over) instead of sizing itself to the GPU's memory.
        settings.update(num_kvcache_blocks=16384, max_model_length=2048)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    plain = LLM(model, **settings)
    if args.method == "draft":
        from myvllm.utils.model_path import bundled_model_path

        draft = args.draft_model or model or bundled_model_path()
        spec = LLM(model, **settings, speculative_method="draft", speculative_model=draft,
                   num_speculative_tokens=args.k)
        print(f"# draft-model speculation ({draft}), k={args.k}, {args.max_tokens} tokens, "
              "greedy")
    else:
        spec = LLM(model, **settings, speculative_method="ngram", num_speculative_tokens=args.k,
                   prompt_lookup_min=args.lookup_min, prompt_lookup_max=args.lookup_max)
        print(f"# n-gram speculation, k={args.k}, lookup {args.lookup_min}..{args.lookup_max}, "
              f"{args.max_tokens} tokens, greedy")
    speculator = spec.engine_core.scheduler.speculator
    assert speculator is not None
    print(f"{'workload':<8} {'batch':>5} {'correct':>7} {'accept':>7} {'mean len':>8} "
          f"{'plain ms/tok':>12} {'spec ms/tok':>11} {'speed-up':>8}")
    for name, base in (("copy", copy), ("free", free)):
        for batch in (int(b) for b in args.batch_sizes.split(",")):
            prompts = [base[i % len(base)] for i in range(batch)]
            ref, plain_ms = time_run(plain, prompts, params)
            before = (speculator.stats.num_drafts, speculator.stats.num_draft_tokens,
                      speculator.stats.num_accepted_tokens)
            out, spec_ms = time_run(spec, prompts, params)
            drafts, drafted, accepted = (now - then for now, then in zip(
                (speculator.stats.num_drafts, speculator.stats.num_draft_tokens,
                 speculator.stats.num_accepted_tokens), before, strict=True))
            # Over the warm-up and the timed run alike (the same tokens twice): ratios only.
            rate = accepted / drafted if drafted else 0.0
            mean_len = 1 + accepted / drafts if drafts else 1.0
            same = sum(a == b for a, b in zip(ref, out, strict=True))
            correct = "OK" if same == len(ref) else "NO"
            print(f"{name:<8} {batch:>5} {correct:>7} {rate:>7.2f} {mean_len:>8.2f} "
                  f"{plain_ms:>12.3f} {spec_ms:>11.3f} {plain_ms / spec_ms:>7.2f}x"
                  + ("" if same == len(ref) else f"   ({same} of {len(ref)} sequences equal)"))
    if args.profile:
        profile_steps(spec, copy[:1], params)


def profile_steps(llm: LLM, prompts: list[str | list[int]], params: SamplingParams) -> None:
    """Where a speculative step's time goes: torch.profiler's counts per engine step of the
    runtime calls that matter (kernel launches, copies, host waits) and its top ops by host
    time. On a CPU only the ops (no CUDA runtime calls)."""
    import collections

    import torch
    from torch.profiler import ProfilerActivity, profile

    core = llm.engine_core
    steps = [0]
    step = core.step

    def counted() -> object:
        steps[0] += 1
        return step()

    core.step = counted  # type: ignore[method-assign]
    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        llm.generate(prompts, params, use_tqdm=False)
    core.step = step  # type: ignore[method-assign]
    counts = collections.Counter(event.name for event in prof.events())
    per_step = max(steps[0], 1)
    print(f"\n# profile: {steps[0]} engine steps, {len(prompts)} sequence(s); per step:")
    for name in ("cudaLaunchKernel", "cudaGraphLaunch", "cudaMemcpyAsync",
                 "cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize",
                 "cudaHostAlloc", "aten::item", "aten::nonzero"):
        print(f"  {name:<24} {counts.get(name, 0) / per_step:8.2f}")
    print(f"  {'aten ops':<24} "
          f"{sum(v for k, v in counts.items() if k.startswith('aten::')) / per_step:8.2f}")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
