"""The decode stall of benchmarks/benchmark_latency.py (64 streams decoding, a 16,000-token
prompt joins) at chosen values of max_prefill_tokens_while_decoding, with the other defaults:
the gaps between streamed tokens, then each step drained. The part of the latency sweep
needed to choose the cap's default beside a serving sweep (benchmarks/benchmark_serving.py),
without the sweep's throughput and time-to-first-token runs.

    PYTHONPATH=src python3 docs/diagnostics/stall_by_cap.py --caps 512,768,1024   # a GPU
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "src"))

from benchmarks.benchmark_latency import build, free_memory, measure_stall  # noqa: E402
from benchmarks.workload import QWEN3_CONFIG, build_random_checkpoint  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--caps", default="512,768,1024")
    args = parser.parse_args()
    shape = dict(num_decoding=64, decode_prompt_len=128, long_prompt_len=16_000, vocab=10_000)
    with tempfile.TemporaryDirectory() as tmp:
        path = build_random_checkpoint(QWEN3_CONFIG, Path(tmp), "cuda", False)
        for cap in (int(c) for c in args.caps.split(",")):
            llm = build(path, False, max_prefill_tokens_while_decoding=cap)
            gaps = measure_stall(llm, **shape, synced=False)
            drained = measure_stall(llm, **shape, salt=1)
            print(f"cap {cap:>5}: gaps {gaps['longest_step_after_join_ms']:.2f} / "
                  f"{gaps['median_step_ms']:.2f} ms = {gaps['stall_x']:.1f}x; drained "
                  f"{drained['longest_step_after_join_ms']:.2f} / "
                  f"{drained['median_step_ms']:.2f} ms = {drained['stall_x']:.1f}x; "
                  f"{gaps['steps_until_first_token']} steps to the prompt's first token",
                  flush=True)
            llm.exit()
            del llm
            free_memory()


if __name__ == "__main__":
    main()
