"""What a client works out before it starts an engine core: the checkpoint, its tokenizer and
the settings that come from it.

    resolved = resolve_engine(Config(model=...))
    resolved.config          eos from the checkpoint, max_model_length from its config.json,
                             async_scheduling on for a GPU
    resolved.model_path      a local folder or .gguf file (downloaded from the hub if need be)
    resolved.tokenizer       or None for a weights-only checkpoint (token-id prompts only)

Both clients call it (LLMEngine before it builds the core in the caller's process, AsyncLLM
before it starts the core process), so bad settings fail here, before any weight is read or
any process started.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import torch

from myvllm.config import Config
from myvllm.layers.weight_loaders import check_tp_divides_heads
from myvllm.models import get_model_class
from myvllm.utils.device import resolve_device
from myvllm.utils.distributed import check_torchrun_world_size, torchrun_env
from myvllm.utils.hf_config import eos_token_ids, load_hf_config, load_tokenizer
from myvllm.utils.model_path import resolve_model_path
from myvllm.value_checks import refusal

logger = logging.getLogger("myvllm")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@dataclasses.dataclass
class ResolvedEngine:
    config: Config
    model_path: str
    hf_config: Any
    tokenizer: Any  # None: the checkpoint has none
    # max_model_length is the checkpoint's (the user gave none), so the core may shorten it
    # to what its KV cache holds.
    fit_length_to_cache: bool


def tokenizer_if_any(model_path: str) -> Any:
    """The checkpoint's tokenizer, or None for a weights-only checkpoint (token-id prompts).

    Random-weight checkpoints built for tests and benchmarks carry no tokenizer; they are
    driven with token ids, and their outputs have text None.
    """
    path = Path(model_path)
    if path.suffix == ".gguf" or any((path / name).is_file() for name in TOKENIZER_FILES):
        return load_tokenizer(model_path)
    return None


def check_tensor_parallel(config: Config, hf_config: Any) -> None:
    """Before any worker starts: the heads split evenly, there are enough GPUs, and under
    torchrun as many processes as ranks (the ranks on this host need this host's GPUs)."""
    tp = config.tensor_parallel_size
    heads = hf_config.num_attention_heads
    check_tp_divides_heads(tp, heads, getattr(hf_config, "num_key_value_heads", heads))
    launch = torchrun_env()
    check_torchrun_world_size(launch, tp)
    gpu_index = tp - 1 if launch is None else launch.local_rank  # the highest one used here
    on_gpu = resolve_device(config).type == "cuda"
    if tp > 1 and on_gpu and gpu_index >= torch.cuda.device_count():
        count = torch.cuda.device_count()
        raise ValueError(f"tensor_parallel_size={tp} needs cuda:{gpu_index} on this host: "
                         f"allowed: cuda:0 to cuda:{count - 1} (CUDA devices visible: {count})")


def check_batch_invariant(config: Config, hf_config: Any) -> None:
    """Batch-invariant mode has no invariant expert kernel yet: fused_moe groups each
    expert's tokens from the whole batch into its tiles, so a token's tile, and the order
    its experts' outputs are summed in, depend on the batch."""
    if config.batch_invariant and getattr(hf_config, "num_experts", None):
        architectures = getattr(hf_config, "architectures", None)
        raise ValueError(f"Config.batch_invariant=True with a mixture-of-experts model "
                         f"({architectures}, {hf_config.num_experts} experts): allowed: "
                         "batch_invariant=False, or a dense model (the expert kernel's order "
                         "depends on the batch)")


def to_config(model: Config | str | None, **kwargs: Any) -> Config:
    """LLM(Config(...)), LLM(Config(...), field=value) or LLM("path", field=value)."""
    if isinstance(model, Config):
        return dataclasses.replace(model, **kwargs) if kwargs else model
    return Config.from_dict({"model": model, **kwargs})


def check_in_process(config: Config) -> None:
    """LLM runs one engine in the caller's process: no data-parallel replicas."""
    if config.data_parallel_size != 1:
        raise refusal("LLM: Config.data_parallel_size", config.data_parallel_size,
                      "1 (LLM runs one engine in this process; more replicas are for `myvllm "
                      "serve`; one LLM per GPU, each in its own process, is the offline "
                      "equivalent)")


def resolve_engine(config: Config) -> ResolvedEngine:
    # Dummy weights need only config.json (and a tokenizer, when there is one).
    model_path = resolve_model_path(config.model, weights=config.load_format != "dummy")
    hf_config = load_hf_config(model_path)
    get_model_class(getattr(hf_config, "architectures", None) or [])  # unknown -> error now
    check_tensor_parallel(config, hf_config)
    check_batch_invariant(config, hf_config)
    tokenizer = tokenizer_if_any(model_path)
    eos = config.eos
    if eos is None:  # -1 when the checkpoint names no eos: stop on max_tokens only
        eos = eos_token_ids(model_path, hf_config, tokenizer) or -1
    max_len: int = hf_config.max_position_embeddings
    user_max_len = config.max_model_length
    if config.max_model_length is not None:
        if config.max_model_length > max_len:
            logger.info(f"max_model_length {config.max_model_length} -> {max_len}: the "
                        "checkpoint's max_position_embeddings")
        max_len = min(config.max_model_length, max_len)
    config = dataclasses.replace(config, eos=eos, max_model_length=max_len)
    use_cuda = resolve_device(config).type == "cuda"
    if config.async_scheduling is None:
        # On where it is measured to pay: on GPUs, one or several (over NCCL, two H200s:
        # Qwen3-8B's shape at batch 1 went from 7.6 to 7.0 ms a token). Off on a CPU, where
        # the host and the "device" are the same cores. Resolved before any worker starts:
        # every rank's ModelRunner must know whether the next step may read this step's
        # tokens from the device (ModelRunner.run).
        # With speculative decoding too: the core reads a step back before planning the
        # next where proposals need it (EngineCore.step).
        config = dataclasses.replace(config, async_scheduling=use_cuda)
    if not use_cuda and not config.enforce_eager:
        logger.info("No GPU: CUDA graphs are off, decoding runs eagerly on the CPU.")
    return ResolvedEngine(config, model_path, hf_config, tokenizer,
                          fit_length_to_cache=user_max_len is None)


def fit_max_model_length(config: Config, num_blocks: int, fit_length_to_cache: bool) -> int:
    """config.max_model_length, lowered to what num_blocks of KV cache hold when it is the
    checkpoint's (fit_length_to_cache): one sequence could never grow longer here. A length
    the caller chose stays (a request that can never fit is refused when it is added)."""
    assert config.max_model_length is not None, "resolve max_model_length first"
    capacity = num_blocks * config.block_size
    if not fit_length_to_cache or config.max_model_length <= capacity:
        return config.max_model_length
    logger.info(f"max_model_length {config.max_model_length} -> {capacity}: what the KV cache "
                f"holds ({num_blocks} blocks of {config.block_size} tokens)")
    return capacity
