"""Smoke test of the benchmark scripts: `--quick` runs, exits 0, and every
implementation it checks is marked correct (OK) before any timing is trusted.

All slow: each test runs a script in a fresh interpreter that imports torch (and triton or
transformers) and then runs kernels in Triton's CPU interpreter or two engines; tens of seconds
apiece on a 2-core CPU. `uv run pytest -m slow` runs them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("command", [
    ["benchmark_prefilling.py"],
    # A cached prefix read through a shuffled block table, against SDPA's lower-right mask.
    ["benchmark_prefilling.py", "--prefix", "24", "--seq-lens", "16"],
    ["benchmark_decoding.py"],
    ["benchmark_moe.py"],
    ["benchmark_sampler.py"],
    # Greedy tokens with n-gram speculation equal plain decoding's, copy-heavy and free.
    ["benchmark_spec_decode.py"],
    # The same with the target as its own draft model.
    ["benchmark_spec_decode.py", "--method", "draft"],
], ids=["prefilling", "prefilling-prefix", "decoding", "moe", "sampler", "spec-decode",
        "spec-decode-draft"])  # fmt: skip
def test_benchmark_quick_mode_is_correct(command: list[str]) -> None:
    pytest.importorskip("triton")
    script, *extra = command
    result = subprocess.run(
        [sys.executable, str(REPO / script), "--quick", *extra],
        capture_output=True, text=True, timeout=300, cwd=REPO, env=dict(os.environ),
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    # Result rows are the lines whose "correct" column holds OK / NO (skips show "-").
    rows = [line.split() for line in result.stdout.splitlines() if not line.startswith("#")]
    verdicts = [word for row in rows for word in row if word in ("OK", "NO")]
    assert verdicts, f"no result rows printed:\n{output[-4000:]}"
    assert "NO" not in verdicts, output[-4000:]
    assert verdicts.count("OK") >= (2 if "--prefix" in extra else 4), output[-4000:]


def test_benchmark_tps_quick_mode(tmp_path: Path) -> None:
    """The end-to-end benchmark on a tiny CPU model: correctness OK before any throughput,
    transformers in the same run, the timeline of every step, the JSON results."""
    timeline, results = tmp_path / "timeline.json", tmp_path / "results.json"
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmark_tps.py"), "--quick", "--timeline", str(timeline),
         "--json", str(results)],
        capture_output=True, text=True, timeout=600, cwd=REPO, env=dict(os.environ),
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "-> OK" in result.stdout, output[-4000:]
    for line in ("myvllm:", "in a second run", "transformers:", "ratio:", "batch-1 decode:"):
        assert line in result.stdout, f"{line!r} missing:\n{output[-4000:]}"
    steps = json.loads(timeline.read_text())
    assert any(s["prefill"] for s in steps) and any(not s["prefill"] for s in steps)
    assert all(s["total_ms"] > 0 for s in steps)
    assert "roofline:" in result.stdout and "whole run:" in result.stdout, output[-4000:]
    assert all(s["ideal_ms"] > 0 and s["bytes_read"] > 0 for s in steps)
    numbers = json.loads(results.read_text())
    assert numbers["correct"] is True and numbers["myvllm_tok_s"] > 0 and numbers["hf_tok_s"] > 0


def test_benchmark_tps_quick_mode_with_dummy_weights(tmp_path: Path) -> None:
    """--load-format dummy: no checkpoint, so no token comparison; the timings still come."""
    results = tmp_path / "results.json"
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmark_tps.py"), "--quick", "--load-format", "dummy",
         "--json", str(results)],
        capture_output=True, text=True, timeout=600, cwd=REPO, env=dict(os.environ),
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "correctness: not checked (dummy weights" in result.stdout, output[-4000:]
    numbers = json.loads(results.read_text())
    assert numbers["load_format"] == "dummy" and numbers["correct"] is None
    assert numbers["myvllm_tok_s"] > 0 and numbers["hf_tok_s"] > 0


def test_benchmark_tps_bundled_cpu_comparison() -> None:
    """--bundled: the CPU comparison (the bundled SmolLM2 GGUF against transformers) runs,
    here on 8 tokens a prompt instead of the recorded 64 (the same code, an eighth of the
    decode steps of both engines)."""
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmark_tps.py"), "--bundled", "--bundled-max-tokens", "8"],
        capture_output=True, text=True, timeout=900, cwd=REPO, env=dict(os.environ),
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "-> OK" in result.stdout and "ratio:" in result.stdout, output[-4000:]


def test_benchmark_tps_without_a_gpu_names_its_cpu_modes() -> None:
    """Without a GPU the full workload would run for tens of minutes on a CPU: the script
    stops at once, as the kernel benchmarks do, and names --quick and --bundled."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    result = subprocess.run([sys.executable, str(REPO / "benchmark_tps.py")], capture_output=True,
                            text=True, timeout=120, cwd=REPO, env=env)
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-2000:]
    assert "needs a CUDA GPU; use --quick or --bundled on the CPU" in result.stderr
