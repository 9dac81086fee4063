"""Code that only the benchmark scripts at the repository root use (the engine never imports
it, so it is not part of the installed package). The scripts run from the repository root,
which puts this folder on their import path as `benchmarks`."""
