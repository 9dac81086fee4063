"""Where the benchmark scripts live and how they import each other.

The repository root holds the two demos and the three benchmarks the guide builds on; every
other benchmark is under benchmarks/ and runs from the root both as `python benchmarks/NAME.py`
and as `python -m benchmarks.NAME`. What scripts share lives in benchmarks/, so nothing imports
a root script. (The scripts' --quick runs: test_benchmark_scripts_quick.py, slow.)"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ROOT_SCRIPTS = {"main.py", "main_llama32.py", "benchmark_prefilling.py", "benchmark_decoding.py",
                "benchmark_tps.py"}


def test_the_root_holds_only_the_demos_and_three_benchmarks() -> None:
    assert {p.name for p in REPO.glob("*.py")} == ROOT_SCRIPTS


def test_nothing_imports_a_root_script() -> None:
    """A root script runs as __main__; imported, it would run its set-up a second time under
    another name. Shared code goes to benchmarks/ instead."""
    stems = {Path(name).stem for name in ROOT_SCRIPTS}
    offenders = []
    for folder in ("benchmarks", "docs", "examples", "src", "tests"):
        for path in (REPO / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                offenders += [f"{path.relative_to(REPO)}:{node.lineno} imports {name}"
                              for name in names if name.split(".")[0] in stems]
    offenders += [f"{p.name} imports a root script" for p in REPO.glob("*.py")
                  if any(f"import {stem}" in p.read_text() for stem in stems - {p.stem})]
    assert not offenders, "\n".join(offenders)


def test_every_benchmark_under_benchmarks_imports_as_a_file_and_as_a_module(
        tmp_path: Path) -> None:
    """Each script's module-level code (its sys.path set-up and imports) runs from a folder
    outside the repository with none of it on the import path, as `python benchmarks/NAME.py`
    finds itself (run as a file, the script must put the root on the path for `benchmarks.*`);
    then each imports as `benchmarks.NAME`, as `python -m benchmarks.NAME` runs it (siblings
    imported as `benchmarks.NAME`, never as top-level modules). One interpreter for all."""
    scripts = sorted((REPO / "benchmarks").glob("benchmark_*.py"))
    assert len(scripts) == 11, scripts
    check = (
        "import importlib, runpy, sys\n"
        "for path in sys.argv[1:]:\n"
        "    runpy.run_path(path, run_name='import_check')\n"
        "for path in sys.argv[1:]:\n"
        "    importlib.import_module('benchmarks.' + path.rsplit('/', 1)[1][:-3])\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run([sys.executable, "-c", check, *map(str, scripts)], cwd=tmp_path,
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
