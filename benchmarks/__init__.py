"""The benchmark scripts beyond the five at the repository root (main.py, main_llama32.py,
benchmark_prefilling.py, benchmark_decoding.py, benchmark_tps.py), and the code every benchmark
shares (device, kernel_timing, workload, baselines, roofline, batch_invariance). The engine
never imports it, so it is not part of the installed package.

A script here runs from the repository root either way, `python benchmarks/NAME.py` or
`python -m benchmarks.NAME`: each puts the root (for `benchmarks.*`) and src/ (for myvllm) on
its import path itself, and imports its neighbours only as `benchmarks.NAME`. Nothing imports a
root script; the root scripts import what they share from here."""
