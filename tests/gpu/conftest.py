"""What the GPU test files share: one random-weight checkpoint of Qwen3-0.6B's real shape.

The whole suite runs in one device call (`python -m pytest tests/gpu`, within 8 minutes on one
H200), so what is costly is made once: the checkpoint is built once per test run (transformers'
random init of 0.6B parameters, ~38 s on the host), for every file that runs an engine or
transformers on that shape. It is drawn on the host, not the GPU: the two draw different
weights, and on the GPU-drawn ones test_gpu.py's seeded top-p rows flip one near-tied token
between the padded graph batch and the eager one (bf16 rounding of two matmul shapes; seen on
an H200 on 2026-12-02, with the engine of before and after that day's layout change alike). Engines sized to the GPU's memory are avoided
for the tiny models (tests/helpers_models.py): their blocks are a few KiB, so a cache sized
to an H200 holds millions of them, each a Python object of the BlockManager (tens of
seconds an engine); those tests fix num_kvcache_blocks instead.
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
QWEN3_CONFIG_DIR = REPO / "configs" / "Qwen3-0.6B"


@pytest.fixture(scope="session")
def qwen3_random_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3-0.6B's real shape (the hub's config.json) with random weights, bf16, as
    safetensors (what transformers and the engine both load)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = tmp_path_factory.mktemp("qwen3-0.6b-random")
    config = AutoConfig.from_pretrained(QWEN3_CONFIG_DIR)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    del model
    gc.collect()
    return path
