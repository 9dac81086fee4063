"""Smoke test of the kernel benchmark scripts: `--quick` runs, exits 0, and every
implementation it checks is marked correct (OK) before any timing is trusted."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("script", ["benchmark_prefilling.py", "benchmark_decoding.py"])
def test_benchmark_quick_mode_is_correct(script: str) -> None:
    pytest.importorskip("triton")
    result = subprocess.run(
        [sys.executable, str(REPO / script), "--quick"],
        capture_output=True, text=True, timeout=300, cwd=REPO, env=dict(os.environ),
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    # Result rows are the lines whose "correct" column holds OK / NO (skips show "-").
    rows = [line.split() for line in result.stdout.splitlines() if not line.startswith("#")]
    verdicts = [word for row in rows for word in row if word in ("OK", "NO")]
    assert verdicts, f"no result rows printed:\n{output[-4000:]}"
    assert "NO" not in verdicts, output[-4000:]
    assert verdicts.count("OK") >= 4, output[-4000:]
