"""Does a timed run of benchmark_tps.py compile anything? (GPU only)

Run from the repository root: python3 docs/diagnostics/late_compiles.py [benchmark_tps.py's
arguments]

benchmark_tps.py runs (as __main__, in this process) with TRITON_CACHE_DIR pointing at an empty folder (worker processes
inherit it), with the start and end of every generate() recorded. Afterwards every cache entry
written after the warm-up generate() is listed with its time: an entry inside the first timed
run is a kernel variant compiled in the middle of it (this found the block table's
"divisible by 16" variant, ~2 s inside the first run on a bare machine).
"""
import os
import runpy
import sys
import tempfile
import time
from pathlib import Path

# Set before torch and Triton are imported. Spawned tensor-parallel workers import this file
# too and inherit the variable: they must write into the same folder, not a new one.
if not os.environ.get("LATE_COMPILES"):
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton-cache-")
    os.environ["LATE_COMPILES"] = "1"
cache = Path(os.environ["TRITON_CACHE_DIR"])
REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO))
from myvllm.engine import llm_engine  # noqa: E402

starts = []
orig = llm_engine.LLMEngine.generate


def generate(self, prompts, *a, **k):
    t = time.time()
    out = orig(self, prompts, *a, **k)
    starts.append((len(prompts), t, time.time()))
    return out


def main() -> None:
    llm_engine.LLMEngine.generate = generate
    script = str(REPO / "benchmark_tps.py")
    sys.argv = [script] + sys.argv[1:]
    runpy.run_path(script, run_name="__main__")
    biggest = max(c[0] for c in starts)
    timed = next(i for i, c in enumerate(starts) if c[0] == biggest)  # the first workload run
    warm_end = starts[timed - 1][2]
    for n, t0, t1 in starts[timed:timed + 3]:
        print(f"(a generate of {n} prompts ran from +{t0 - warm_end:.2f} to +{t1 - warm_end:.2f} s "
              "after the warm-up generate)")
    late = sorted((p.stat().st_mtime - warm_end, p.name, p.parent.name[:12])
                  for p in cache.rglob("*") if p.is_file() and p.stat().st_mtime > warm_end)
    for dt, name, key in late:
        print(f"   +{dt:.2f} s after the warm-up generate: {key} {name}")
    if not late:
        print("(no cache entry written after the warm-up generate)")


if __name__ == "__main__":  # tensor-parallel workers are spawned: they import this file
    main()
