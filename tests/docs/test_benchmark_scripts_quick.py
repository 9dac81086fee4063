"""Smoke test of the benchmark scripts: `--quick` runs, exits 0, and every
implementation it checks is marked correct (OK) before any timing is trusted.

All slow: the scripts import torch (and triton or transformers) and then run kernels in Triton's
CPU interpreter or two engines; tens of seconds apiece on a 2-core CPU. `uv run pytest -m slow`
runs them. They all run in one fresh interpreter, one after another, each as `python SCRIPT
ARGS` would run it (scripts_in_one_process.py): a dozen interpreters would import torch a dozen
times, about 7 CPU-seconds each. Each test still checks its own run's exit status and output."""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
IN_ONE_PROCESS = Path(__file__).with_name("scripts_in_one_process.py")

pytestmark = pytest.mark.slow

# Each run with --quick after the script (test_docs.py looks for ["[benchmarks/]benchmark_X.py"]
# here).
QUICK_RUNS = {
    "prefilling": ["benchmark_prefilling.py"],
    # A cached prefix read through a shuffled block table, against SDPA's lower-right mask.
    "prefilling-prefix": ["benchmark_prefilling.py", "--prefix", "24", "--seq-lens", "16"],
    "decoding": ["benchmark_decoding.py"],
    "moe": ["benchmarks/benchmark_moe.py"],
    "invariant-matmul": ["benchmarks/benchmark_invariant_matmul.py"],
    # Both decode programs (dot, CUDA cores) over a 16-bit and an fp8 cache.
    "decode-attention": ["benchmarks/benchmark_decode_attention.py"],
    "sampler": ["benchmarks/benchmark_sampler.py"],
    # Greedy tokens with n-gram speculation equal plain decoding's, copy-heavy and free.
    "spec-decode": ["benchmarks/benchmark_spec_decode.py"],
    # The same with the target as its own draft model.
    "spec-decode-draft": ["benchmarks/benchmark_spec_decode.py", "--method", "draft"],
}


@pytest.fixture(scope="module")
def outputs_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("benchmark_outputs")


def tps_runs(out: Path) -> dict[str, list[str]]:
    return {
        # The end-to-end benchmark on a tiny CPU model, its timeline and JSON results.
        "tps-quick": ["benchmark_tps.py", "--quick", "--timeline", str(out / "timeline.json"),
                      "--json", str(out / "results.json")],
        # --load-format dummy: no checkpoint, so no token comparison.
        "tps-dummy": ["benchmark_tps.py", "--quick", "--load-format", "dummy",
                      "--json", str(out / "dummy_results.json")],
        # --bundled on 8 tokens a prompt instead of the recorded 64.
        "tps-bundled": ["benchmark_tps.py", "--bundled", "--bundled-max-tokens", "8"],
    }


# Runs checked by a test of their own below (their output has no "correct" column).
OTHER_RUNS = {
    # The front end and the engine core process with fake steps: 16 streams served.
    "frontend": ["benchmarks/benchmark_frontend.py", "--quick"],
}


@pytest.fixture(scope="module")
def runs(outputs_dir: Path) -> dict[str, dict[str, Any]]:
    """Every run of this file in one interpreter: {name: returncode, stdout, stderr}."""
    pytest.importorskip("triton")
    quick = {name: [script, "--quick", *extra] for name, (script, *extra) in QUICK_RUNS.items()}
    named = {**quick, **tps_runs(outputs_dir), **OTHER_RUNS}
    runs_file, results_file = outputs_dir / "runs.json", outputs_dir / "run_results.json"
    runs_file.write_text(json.dumps(list(named.values())))
    # The kernel runs alone took up to 300 s, the tps runs up to 600 and 900 s each.
    result = subprocess.run(
        [sys.executable, str(IN_ONE_PROCESS), str(runs_file), str(results_file)],
        capture_output=True, text=True, timeout=3600, cwd=REPO, env=dict(os.environ),
    )  # fmt: skip
    assert result.returncode == 0 and results_file.exists(), (
        "the interpreter running the scripts failed:\n" + (result.stdout + result.stderr)[-4000:])
    return dict(zip(named, json.loads(results_file.read_text())))


def output_of(run: dict[str, Any]) -> str:
    return str(run["stdout"]) + str(run["stderr"])


@pytest.mark.parametrize("name", list(QUICK_RUNS))
def test_benchmark_quick_mode_is_correct(runs: dict[str, dict[str, Any]], name: str) -> None:
    run = runs[name]
    output = output_of(run)
    assert run["returncode"] == 0, output[-4000:]
    # Result rows are the lines whose "correct" column holds OK / NO (skips show "-").
    rows = [line.split() for line in run["stdout"].splitlines() if not line.startswith("#")]
    verdicts = [word for row in rows for word in row if word in ("OK", "NO")]
    assert verdicts, f"no result rows printed:\n{output[-4000:]}"
    assert "NO" not in verdicts, output[-4000:]
    assert verdicts.count("OK") >= (2 if "--prefix" in QUICK_RUNS[name] else 4), output[-4000:]


def test_benchmark_frontend_quick_mode(runs: dict[str, dict[str, Any]]) -> None:
    """The CPU harness of the front end: every stream served in full, then the CPU time a
    token costs in the front end and in the core process."""
    run = runs["frontend"]
    stdout, output = run["stdout"], output_of(run)
    assert run["returncode"] == 0, output[-4000:]
    assert "requested number of tokens: OK" in stdout, output[-4000:]
    for line in ("   front end: ", "core process: ", "tokens an event"):
        assert line in stdout, f"{line!r} missing:\n{output[-4000:]}"


def test_benchmark_tps_quick_mode(runs: dict[str, dict[str, Any]], outputs_dir: Path) -> None:
    """The end-to-end benchmark on a tiny CPU model: correctness OK before any throughput,
    transformers in the same run, the timeline of every step, the JSON results."""
    run = runs["tps-quick"]
    stdout, output = run["stdout"], output_of(run)
    assert run["returncode"] == 0, output[-4000:]
    assert "-> OK" in stdout, output[-4000:]
    for line in ("myvllm:", "in a second run", "transformers:", "ratio:", "batch-1 decode:"):
        assert line in stdout, f"{line!r} missing:\n{output[-4000:]}"
    steps = json.loads((outputs_dir / "timeline.json").read_text())
    assert any(s["prefill"] for s in steps) and any(not s["prefill"] for s in steps)
    assert all(s["total_ms"] > 0 for s in steps)
    assert "roofline:" in stdout and "whole run:" in stdout, output[-4000:]
    assert all(s["ideal_ms"] > 0 and s["bytes_read"] > 0 for s in steps)
    numbers = json.loads((outputs_dir / "results.json").read_text())
    assert numbers["correct"] is True and numbers["myvllm_tok_s"] > 0 and numbers["hf_tok_s"] > 0


def test_benchmark_tps_quick_mode_with_dummy_weights(runs: dict[str, dict[str, Any]],
                                                     outputs_dir: Path) -> None:
    """--load-format dummy: no checkpoint, so no token comparison; the timings still come."""
    run = runs["tps-dummy"]
    assert run["returncode"] == 0, output_of(run)[-4000:]
    assert "correctness: not checked (dummy weights" in run["stdout"], output_of(run)[-4000:]
    numbers = json.loads((outputs_dir / "dummy_results.json").read_text())
    assert numbers["load_format"] == "dummy" and numbers["correct"] is None
    assert numbers["myvllm_tok_s"] > 0 and numbers["hf_tok_s"] > 0


def test_benchmark_tps_bundled_cpu_comparison(runs: dict[str, dict[str, Any]]) -> None:
    """--bundled: the CPU comparison (the bundled SmolLM2 GGUF against transformers) runs,
    here on 8 tokens a prompt instead of the recorded 64 (the same code, an eighth of the
    decode steps of both engines)."""
    run = runs["tps-bundled"]
    assert run["returncode"] == 0, output_of(run)[-4000:]
    assert "-> OK" in run["stdout"] and "ratio:" in run["stdout"], output_of(run)[-4000:]


def test_benchmark_tps_without_a_gpu_names_its_cpu_modes(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Without a GPU the full workload would run for tens of minutes on a CPU: the script
    stops at once, as the kernel benchmarks do, and names --quick and --bundled. Run here, in
    this process (torch is imported already), with CUDA reported absent."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sys, "argv", [str(REPO / "benchmark_tps.py")])
    monkeypatch.setattr(sys, "path", list(sys.path))  # the script puts src/ first
    with pytest.raises(SystemExit) as info:
        runpy.run_path(str(REPO / "benchmark_tps.py"), run_name="__main__")
    # SystemExit of a message: the interpreter prints it to stderr and exits with 1.
    assert isinstance(info.value.code, str)
    assert "needs a CUDA GPU; use --quick or --bundled on the CPU" in info.value.code
