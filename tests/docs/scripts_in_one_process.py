"""Run several repository scripts one after another in this one interpreter, each as
`python SCRIPT ARGS...` would run it, and write what each printed and its exit status as JSON.

    python tests/docs/scripts_in_one_process.py RUNS.json RESULTS.json

RUNS.json is a list of argv lists (the script first, relative to the repository root); RESULTS.json
gets one {"returncode", "stdout", "stderr"} per run, in order. A script's uncaught exception is
exit status 1 with its traceback on stderr, and SystemExit is read as the interpreter reads it.

Why: every fresh interpreter imports torch (and triton, transformers) again, about 7 CPU-seconds
on a 2-core machine, which a dozen quick benchmark runs would pay a dozen times.
test_benchmark_scripts_quick.py then checks each run's output on its own.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import runpy
import sys
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def exit_status(code: object, stderr: io.StringIO) -> int:
    """The status `raise SystemExit(code)` gives a process: None is 0, a number is itself,
    anything else is printed to stderr and is 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=stderr)
    return 1


def run_script(argv: list[str]) -> dict[str, object]:
    """argv[0] run as __main__ with sys.argv = argv, its output captured."""
    stdout, stderr = io.StringIO(), io.StringIO()
    script = str(REPO / argv[0])
    saved_argv = sys.argv
    sys.argv = [script, *argv[1:]]
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            try:
                runpy.run_path(script, run_name="__main__")
                returncode = 0
            except SystemExit as exit_:
                returncode = exit_status(exit_.code, stderr)
            except BaseException:  # noqa: BLE001 - the script's crash is its result
                traceback.print_exc(file=stderr)
                returncode = 1
    finally:
        sys.argv = saved_argv
    return {"returncode": returncode, "stdout": stdout.getvalue(), "stderr": stderr.getvalue()}


def main() -> None:
    runs_path, results_path = sys.argv[1:3]
    # As `python SCRIPT` would from the repository root: the scripts import their helpers from
    # benchmarks/ (those under benchmarks/ put the root on sys.path themselves).
    os.chdir(REPO)
    sys.path.insert(0, str(REPO))
    runs = json.loads(Path(runs_path).read_text())
    results = [run_script(argv) for argv in runs]
    Path(results_path).write_text(json.dumps(results))


if __name__ == "__main__":
    main()
