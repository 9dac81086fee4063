"""What a plain request runs: the files of src/myvllm in which a greedy generate() of a few short
prompts executes statements, on a CPU, tiny random Qwen3, default Config but device="cpu", no
option asked for (no sampling control, speculation, logprobs, n > 1 or structured output).

Only the steps are measured: coverage starts after the LLM is built (loading, sizing and
start-up are not a request's work) and stops when generate() returns.

    uv run python tests/plain_request_coverage.py          # the table, file by file
    uv run python tests/plain_request_coverage.py --json   # the figures, for the test

The test (tests/test_plain_request.py) runs this in a fresh interpreter, so nothing another
test imported or ran counts.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import coverage

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "myvllm"


def measure() -> dict[str, dict[str, int]]:
    """{file relative to src/myvllm: {"statements": n, "run": n}} for every file that ran."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from helpers_models import tiny_checkpoint

    from myvllm import LLM, SamplingParams

    llm = LLM(str(tiny_checkpoint("qwen3")), device="cpu")
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9], [11, 12, 13, 14, 15, 16, 17]]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    cov = coverage.Coverage(data_file=None, include=[str(PACKAGE / "*")], branch=False)
    cov.start()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    cov.stop()
    assert all(len(out["token_ids"]) == 4 for out in outputs), outputs
    data = cov.get_data()
    figures: dict[str, dict[str, int]] = {}
    for filename in data.measured_files():
        executed = data.lines(filename) or []
        if not executed:
            continue
        _, statements, _, _ = cov.analysis(filename)
        figures[str(Path(filename).relative_to(PACKAGE))] = {
            "statements": len(statements), "run": len(set(executed) & set(statements))}
    return figures


def main() -> None:
    figures = measure()
    if "--json" in sys.argv:
        print(json.dumps(figures))
        return
    for name, f in sorted(figures.items()):
        print(f"{f['run']:5d} / {f['statements']:5d}  {name}")
    total = sum(f["statements"] for f in figures.values())
    print(f"{len(figures)} files, {total} statements in them")


if __name__ == "__main__":
    main()
