"""Does a request's output depend on what else ran with it? The determinism runs of
docs/reliability.md.

Workload (the one that found the problem): the Qwen3-0.6B shape with dummy weights
(configs/Qwen3-0.6B, load_format "dummy": the same seeded weights in every engine), 128
prompts of a shared 512-token prefix and a tail of 8-64 tokens of their own, 128 greedy
tokens each with the logprob of every token. The same 128 requests run:

    cold        all 128 in one generate(), prefix caching off        (the reference)
    alone       8 of them one at a time (batch 1), prefix caching off
    batch 256   the 128 among 128 other prompts of other lengths, in one generate()
    prefix hit  prefix caching on, after a request that cached the 512-token prefix
    chunked     max_num_batched_tokens=256: each prompt runs in 3 chunks

and each is compared with cold: how many requests got the same tokens, and how many the
same tokens and bit-identical logprobs. With Config.batch_invariant all must agree.

    PYTHONPATH=src python3 -m benchmarks.batch_invariance                    # both modes
    PYTHONPATH=src python3 -m benchmarks.batch_invariance --modes invariant  # the mode only

GPU only (a CPU would take hours at this shape); tests/gpu/test_gpu_batch_invariant.py
runs the mode and asserts.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
QWEN3_06B = REPO / "configs" / "Qwen3-0.6B"
NUM_PROMPTS, PREFIX_LEN, MAX_TOKENS, NUM_ALONE = 128, 512, 128, 8


@dataclass
class Agreement:
    scenario: str
    requests: int
    same_tokens: int
    same_tokens_and_logprobs: int


def workload(seed: int = 0) -> tuple[list[int], list[list[int]], list[list[int]]]:
    """(the shared prefix, the 128 prompts, 128 filler prompts of 50-600 tokens)."""
    rng = random.Random(seed)
    prefix = [rng.randrange(10000) for _ in range(PREFIX_LEN)]
    prompts = [prefix + [rng.randrange(10000) for _ in range(rng.randint(8, 64))]
               for _ in range(NUM_PROMPTS)]
    fillers = [[rng.randrange(10000) for _ in range(rng.randint(50, 600))]
               for _ in range(NUM_PROMPTS)]
    return prefix, prompts, fillers


def outputs(llm: Any, prompts: list[list[int]], max_tokens: int = MAX_TOKENS
            ) -> list[dict[str, Any]]:
    """Greedy, with each token's logprob (and the top one's)."""
    from myvllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                            logprobs=1)
    return llm.generate(prompts, params, use_tqdm=False)


def engine(batch_invariant: bool, **settings: Any) -> Any:
    from myvllm import LLM

    # A fixed cache (256 sequences of up to 1,024 tokens), not one sized to the GPU's
    # memory: the engines of one run come one after another, and the memory an exited
    # engine held is not always back in time for the next one's sizing.
    return LLM(str(QWEN3_06B), load_format="dummy", max_model_length=1024,
               max_num_sequences=256, batch_invariant=batch_invariant,
               num_kvcache_blocks=256 * 1024 // 16, **settings)


def close(llm: Any) -> None:
    import torch

    llm.exit()
    del llm
    gc.collect()
    torch.cuda.empty_cache()


def compare(name: str, cold: list[dict[str, Any]], other: list[dict[str, Any]]) -> Agreement:
    same = [a["token_ids"] == b["token_ids"] for a, b in zip(cold, other, strict=True)]
    return Agreement(name, len(other), sum(same),
                     sum(s and a["logprobs"] == b["logprobs"]
                         for s, a, b in zip(same, cold, other)))


def run_scenarios(batch_invariant: bool, max_tokens: int = MAX_TOKENS) -> list[Agreement]:
    """Every scenario of the module docstring, compared with cold (max_tokens greedy tokens
    a request; the test of the mode runs fewer than the recorded 128)."""
    prefix, prompts, fillers = workload()
    llm = engine(batch_invariant, enable_prefix_caching=False)
    cold = outputs(llm, prompts, max_tokens)
    alone = [outputs(llm, [p], max_tokens)[0] for p in prompts[:NUM_ALONE]]
    mixed = outputs(llm, [x for pair in zip(fillers, prompts) for x in pair], max_tokens)[1::2]
    close(llm)
    llm = engine(batch_invariant, enable_prefix_caching=True)
    outputs(llm, [prefix], max_tokens=1)  # caches the prefix's 32 blocks
    hit = outputs(llm, prompts, max_tokens)
    if min(o["num_cached_tokens"] for o in hit) < PREFIX_LEN:
        raise RuntimeError("prefix hit: a prompt did not hit the cached 512-token prefix")
    close(llm)
    llm = engine(batch_invariant, enable_prefix_caching=False, max_num_batched_tokens=256)
    chunked = outputs(llm, prompts, max_tokens)
    close(llm)
    return [compare("alone", cold[:NUM_ALONE], alone), compare("batch 256", cold, mixed),
            compare("prefix hit", cold, hit), compare("chunked", cold, chunked)]


def main() -> None:
    parser = argparse.ArgumentParser(description="The determinism runs of "
                                     "docs/reliability.md: bf16, Qwen3-0.6B's shape")
    parser.add_argument("--modes", default="invariant,default",
                        help="comma-separated: invariant (batch_invariant=True), default")
    parser.add_argument("--json", help="write the results here as JSON")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/batch_invariance.py needs a CUDA GPU (no CPU mode: a CPU "
                         "would take hours at this shape; the CPU's tests are "
                         "tests/kernels/test_batch_invariant.py)")

    results: dict[str, Any] = {"device": torch.cuda.get_device_name(), "dtype": "bfloat16"}
    for mode in args.modes.split(","):
        if mode not in ("invariant", "default"):
            raise SystemExit(f"--modes: unknown mode {mode!r}; known: invariant, default")
        start = time.perf_counter()
        rows = run_scenarios(mode == "invariant")
        print(f"batch_invariant={mode == 'invariant'} ({time.perf_counter() - start:.0f} s):")
        for r in rows:
            print(f"  {r.scenario:<11} same tokens {r.same_tokens}/{r.requests}, same tokens "
                  f"and logprobs {r.same_tokens_and_logprobs}/{r.requests}")
        results[mode] = [r.__dict__ for r in rows]
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
