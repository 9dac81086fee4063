"""What an EngineCore runs on, built once before its first step: rank 0's ModelRunner (and
under tensor parallelism the Executor of the worker processes), the KV cache sized from
memory, and the settings that follow from its size.

    parts = start_core_parts(core, config, model_path, hf_config, fit_length_to_cache)
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

from myvllm.config import Config
from myvllm.engine.model_runner import ModelRunner
from myvllm.engine.startup import fit_max_model_length
from myvllm.executor.executor import Executor
from myvllm.spec_decode.draft_proposer import make_draft_proposer
from myvllm.utils.device import resolve_device
from myvllm.utils.hf_config import gguf_parsed_once, load_hf_config
from myvllm.worker.cpu_threads import claim_cpu_threads


@dataclasses.dataclass
class CoreParts:
    config: Config  # num_kvcache_blocks from memory, max_model_length fitted to it
    max_model_length: int
    vocab_size: int
    model_runner: ModelRunner  # rank 0's
    # Tensor parallelism: the worker processes (ranks 1..N-1), None with one rank.
    workers: Executor | None
    # A CPU: gives the caller its own thread count back at shutdown (None on a GPU).
    restore_threads: weakref.finalize | None


def start_core_parts(owner: object, config: Config, model_path: str, hf_config: Any,
                     fit_length_to_cache: bool) -> CoreParts:
    """Load the model on every rank and size the KV cache, for the EngineCore owner. config
    as the client resolved it (eos and max_model_length known); hf_config None: read from
    model_path. fit_length_to_cache: see startup.fit_max_model_length."""
    with gguf_parsed_once():  # config and weights share one parse of a GGUF
        if hf_config is None:
            hf_config = load_hf_config(model_path)
        use_cuda = resolve_device(config).type == "cuda"
        # A CPU: this process (and each worker) on its share of the cores; the caller's
        # thread count comes back at shutdown.
        cpu_threads: int | None = None
        restore_threads: weakref.finalize | None = None
        if not use_cuda:
            cpu_threads, restore_threads = claim_cpu_threads(owner, config, hf_config)
        workers: Executor | None = None
        try:
            if config.tensor_parallel_size > 1:
                workers = Executor(config, model_path, hf_config, use_cuda, cpu_threads)
                model_runner = workers.model_runner
                num_blocks = workers.call("initialize_cache")  # on every rank
            else:
                model_runner = ModelRunner(config, 0, model_path, hf_config)
                # speculative_method "draft" (one GPU only): the draft model beside it.
                draft = make_draft_proposer(config, hf_config)
                if draft is not None:
                    assert model_runner.verifier is not None
                    model_runner.verifier.draft = draft
                num_blocks = model_runner.initialize_cache()
        except BaseException:
            stop_core_parts(workers, restore_threads, now=True)
            raise
    max_len = fit_max_model_length(config, num_blocks, fit_length_to_cache)
    resolved = dataclasses.replace(config, num_kvcache_blocks=num_blocks,
                                   max_model_length=max_len)
    return CoreParts(resolved, max_len, hf_config.vocab_size, model_runner, workers,
                     restore_threads)


def stop_core_parts(workers: Executor | None, restore_threads: weakref.finalize | None,
                    now: bool = False) -> None:
    """EngineCore.shutdown (idempotent): stop the worker processes and release the process
    group, and give the caller its own thread count back. now: after an interrupted step or
    start-up, when the ranks may have stopped in different places (one inside a
    collective), the workers stop without waiting."""
    if workers is not None:
        if now:
            workers.stop_workers_now()
        else:
            workers.shutdown()
    if restore_threads is not None:
        restore_threads()
