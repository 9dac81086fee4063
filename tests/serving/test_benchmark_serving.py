"""benchmarks/benchmark_serving.py --quick: a tiny model served in its own process, requests at
once and then as a Poisson process at 0.8x the measured peak, by each of the three clients in
turn, spread over two client processes; every request must complete with the number of tokens
it asked for before any figure is reported; the prefix-cache hit rate of each rate comes from
the server's /metrics."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_benchmark_serving_quick(tmp_path: Path) -> None:
    results = tmp_path / "results.json"
    run = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "benchmark_serving.py"), "--quick",
         "--clients", "raw,httpx,aiohttp", "--client-processes", "2", "--json", str(results)],
        capture_output=True, text=True, timeout=600, cwd=REPO, env=dict(os.environ),
    )  # fmt: skip
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-4000:]
    assert "requested number of tokens: OK" in run.stdout, output[-4000:]
    rows = json.loads(results.read_text())["results"]
    assert [(row["client"], row["rate_spec"]) for row in rows] == [
        (client, rate) for client in ("raw", "httpx", "aiohttp") for rate in ("inf", "0.8x")]
    assert "client   rate    output tok/s  vs offline" in run.stdout, output[-4000:]
    for row in rows:
        assert row["completed"] == 8 and row["failed"] == 0
        assert row["client_processes"] == 2 and row["client_cpu_s"] > 0
        assert row["request_throughput"] > 0 and row["output_tok_s"] > 0
        for key in ("ttft_ms", "tpot_ms", "itl_ms"):
            assert 0 < row[key]["p50"] <= row[key]["p90"] <= row[key]["p99"], (key, row)
        assert 0.0 <= row["prefix_hit_rate"] <= 1.0
    for first, second in zip(rows[::2], rows[1::2]):
        # A client's first rate finds none of its prompts cached (each client's token ids
        # are its own, the warm-up's too); its second sends them again: their full blocks hit.
        assert first["prefix_hit_rate"] == 0.0, first
        assert second["prefix_hit_rate"] > 0.0, second
