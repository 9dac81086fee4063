"""Llama demo: `uv run python main_llama32.py` (see --help). Bundled SmolLM2 offline."""

from myvllm.demo import run_demo

if __name__ == "__main__":  # required: tensor-parallel workers are spawned processes
    run_demo("meta-llama/Llama-3.2-1B-Instruct")
