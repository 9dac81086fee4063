"""The bench workload (nano-vllm's bench.py) and the checkpoints it runs on, shared by
benchmark_tps.py, benchmarks/benchmark_latency.py, benchmarks/benchmark_serving.py and
docs/diagnostics/: random prompts and output lengths, the model (random weights of a
config.json, or dummy weights made in place) and the batch-1 decode measurement.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
QWEN3_CONFIG = REPO / "configs" / "Qwen3-0.6B" / "config.json"


def tiny_qwen3_config():
    """The --quick model: a 2-layer Qwen3 that runs in seconds on a CPU."""
    from transformers import Qwen3Config

    hf_config = Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=16, max_position_embeddings=1024, tie_word_embeddings=True)
    hf_config.architectures = ["Qwen3ForCausalLM"]
    return hf_config


def build_random_checkpoint(config_path: Path | None, out_dir: Path, device: str,
                            quick: bool) -> Path:
    """Random weights of the architecture in config_path (or a tiny Qwen3), as safetensors."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if quick:
        hf_config = tiny_qwen3_config()
    else:
        assert config_path is not None
        hf_config = AutoConfig.from_pretrained(config_path.parent)
    torch.manual_seed(0)
    dtype = torch.float32 if quick else torch.bfloat16
    model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype).to(device)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def holds_only_a_config(path: Path) -> bool:
    """A folder with config.json and no weights (configs/NAME): run it with dummy weights."""
    return (path.is_dir() and (path / "config.json").is_file()
            and not any(path.glob("*.safetensors")) and not any(path.glob("*.gguf")))


def pick_model(args: argparse.Namespace, tmp: Path, device: str) -> tuple[Path, str]:
    """(the model myvllm runs, its load format), from --model and --load-format."""
    if args.model:
        path = Path(args.model)
        return path, args.load_format or ("dummy" if holds_only_a_config(path) else "auto")
    if args.load_format == "dummy":
        if args.quick:
            tiny_qwen3_config().save_pretrained(str(tmp))  # config.json alone
            return tmp, "dummy"
        return QWEN3_CONFIG.parent, "dummy"
    return build_random_checkpoint(QWEN3_CONFIG, tmp, device, args.quick), "auto"



def make_workload(num_seqs: int, min_len: int, max_input: int, max_output: int,
                  vocab: int, min_output: int | None = None) -> tuple[list[list[int]], list[int]]:
    """num_seqs prompts of random token ids, lengths uniform in min_len..max_input, and their
    max_tokens uniform in min_output..max_output (min_output None: min_len); Python's random
    seeded with 0. A range of one value (min = max) gives fixed lengths."""
    rng = random.Random(0)
    prompts = [[rng.randint(0, vocab - 1) for _ in range(rng.randint(min_len, max_input))]
               for _ in range(num_seqs)]
    low = min_len if min_output is None else min_output
    max_tokens = [rng.randint(low, max_output) for _ in range(num_seqs)]
    return prompts, max_tokens


def fresh_copy(prompts: list[list[int]], key: int = 1) -> list[list[int]]:
    """The same workload with every token id XOR key: equal lengths, and the prefix cache,
    which still holds the prompts of the other keys (0 = the original), serves none of it."""
    return [[t ^ key for t in p] for p in prompts]



def batch1_ms_per_token(llm: Any, prompt: list[int]) -> tuple[float, float, float]:
    """Batch-1 decode ms a token at the prompt's context: (129 tokens - 1 token) / 128, five
    repeats each after a warm run -> (median, fastest, slowest)."""
    from myvllm import SamplingParams

    timings: dict[int, list[float]] = {1: [], 129: []}
    for n in (1, 129):
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        llm.generate([prompt], params, use_tqdm=False)  # warm
        for _ in range(5):
            start = time.perf_counter()
            llm.generate([prompt], params, use_tqdm=False)
            timings[n].append(time.perf_counter() - start)
    per_token = sorted((t129 - t1) / 128 * 1e3 for t129, t1 in zip(timings[129], timings[1]))
    return statistics.median(per_token), per_token[0], per_token[-1]
