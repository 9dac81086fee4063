"""Tensor parallelism on the CPU: two processes over gloo give the tokens of one.

Also the workers' lifetime: they are gone after exit() and after a failed start-up.
"""

from __future__ import annotations

import multiprocessing
import shutil
from pathlib import Path

import pytest
from helpers_models import tiny_checkpoint
from safetensors.torch import load_file, save_file
from test_engine import GREEDY, random_prompts

from myvllm import LLM

pytestmark = pytest.mark.slow


def workers_alive(llm: LLM) -> list[bool]:
    assert llm._pool is not None
    return [p.is_alive() for p in llm._pool.processes]


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_tp2_gives_the_tokens_of_tp1(kind: str) -> None:
    path = str(tiny_checkpoint(kind))
    prompts = random_prompts([7, 13, 4])
    kwargs = dict(block_size=4, max_model_length=64, max_num_batched_tokens=128)
    single = LLM(path, **kwargs).generate(prompts, GREEDY, use_tqdm=False)
    llm = LLM(path, tensor_parallel_size=2, **kwargs)
    assert workers_alive(llm) == [True]
    sharded = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o["token_ids"] for o in sharded] == [o["token_ids"] for o in single]
    llm.exit()
    assert workers_alive(llm) == [False]
    llm.exit()  # idempotent


def test_no_worker_left_after_a_start_up_error(tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(tiny_checkpoint("qwen3"), broken)
    tensors = load_file(broken / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(Exception, match="down_proj"):
        LLM(str(broken), tensor_parallel_size=2, max_model_length=64,
            max_num_batched_tokens=128)
    assert multiprocessing.active_children() == []


def test_tp_size_must_divide_the_heads() -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size=3"):
        LLM(str(tiny_checkpoint("qwen3")), tensor_parallel_size=3)
    assert multiprocessing.active_children() == []
