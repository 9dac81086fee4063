"""A plain request runs the core and nothing else: the measure of the engine a learner reads.

A greedy generate() of three short prompts (tiny random Qwen3, a CPU, default Config but
device="cpu", no sampling option, no speculation, no logprobs, n = 1) is run under coverage in
a fresh interpreter (tests/plain_request_coverage.py); during its steps it may execute
statements in at most MAX_FILES files of src/myvllm, holding at most MAX_STATEMENTS
statements in all, and in no module of an optional feature. docs/architecture.md reports the
figures.

MAX_STATEMENTS is where the core stands (1,480 measured on 2026-12-06, a few above, so that a
regression fails; docs/architecture.md says what is left). Lower it as the core shrinks; never
raise it to let a feature's code into a plain request's path.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

MAX_FILES = 25
MAX_STATEMENTS = 1482

# The optional features' modules: each runs only when a request or the Config asks for it.
FEATURE_MODULES = (
    "spec_decode/",              # speculative decoding
    "structured_output/",        # grammars
    "serving/",                  # the engine-core process, AsyncLLM, data parallelism
    "entrypoints/",              # the HTTP server and the CLI
    "executor/",                 # tensor-parallel workers, their launch and watchdog
    "utils/distributed.py",      # collectives (tensor parallelism)
    "sample/sampling_controls.py",  # penalties, min_p, logit_bias, min_tokens, stop ids
    "sample/logprobs.py",        # logprobs
    "sample/logits_features.py",  # the features that act on a step's logits
    "sample/forks.py",           # n > 1
    "sample/extras.py",          # the features' per-request state
    "kernels/fp8_kv",            # the fp8 KV cache
    "kernels/batch_invariant.py",  # batch-invariant mode
    "kernels/invariant_matmul_kernel.py",
    "layers/vocab_parallel.py",  # the vocabulary's rows over tensor-parallel ranks
    "layers/fused.py",           # fusion of an op into the next layer's kernel (a GPU)
    "layers/logprobs.py",
    "layers/logits_processors.py",
    "layers/token_bitmask.py",
)

SCRIPT = Path(__file__).resolve().parent / "plain_request_coverage.py"


def test_a_plain_request_runs_only_the_core() -> None:
    result = subprocess.run([sys.executable, str(SCRIPT), "--json"], capture_output=True,
                            text=True, stdin=subprocess.DEVNULL, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    figures: dict[str, dict[str, int]] = json.loads(result.stdout.strip().splitlines()[-1])
    table = "\n".join(f"  {f['run']:4d} of {f['statements']:4d} statements  {name}"
                      for name, f in sorted(figures.items()))
    features = [name for name in figures if name.startswith(FEATURE_MODULES)]
    assert not features, f"a plain request ran feature modules {features}:\n{table}"
    assert len(figures) <= MAX_FILES, f"{len(figures)} files ran (at most {MAX_FILES}):\n{table}"
    statements = sum(f["statements"] for f in figures.values())
    assert statements <= MAX_STATEMENTS, (
        f"the files that ran hold {statements} statements (at most {MAX_STATEMENTS}):\n{table}")
