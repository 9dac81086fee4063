"""Qwen3 demo: `uv run python main.py` (see --help). Falls back to the bundled model offline."""

from myvllm.demo import run_demo

if __name__ == "__main__":  # required: tensor-parallel workers are spawned processes
    run_demo("Qwen/Qwen3-0.6B")
