"""Run a model's prefill as each rank of a tensor-parallel group on the CPU, over gloo.

    results = run_ranks(prefill_logits, 2, paths, prompts, module)   # one result per rank
    pretend_rank(monkeypatch, rank, size)   # in this process: layers built next are rank's


The ranks are spawned processes on a free local port, as the engine's workers are
(executor/tp_workers.py), but without the engine: each rank builds the model class, loads its
shard of the checkpoint through the weight loaders and runs one prefill forward. That is all
a model file decides under tensor parallelism, in a few seconds instead of an engine's start.
"""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
import queue
import sys
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

def pretend_rank(monkeypatch: Any, rank: int, size: int) -> None:
    """Layers built from now on (in this test) own the shards of TP rank `rank` of `size`,
    without processes; their forward would still need a process group for its collectives."""
    import myvllm.layers.embedding_head as embedding_head
    import myvllm.layers.linear as linear

    for module in (linear, embedding_head):
        monkeypatch.setattr(module, "get_tp_rank", lambda: rank)
        monkeypatch.setattr(module, "get_tp_size", lambda: size)


# A rank whose peer failed before a collective would wait in it; the parent ends it sooner.
COLLECTIVE_TIMEOUT = timedelta(seconds=60)


def _rank_main(fn: Callable[..., Any], rank: int, world_size: int, init_method: str,
               results: Any, args: tuple[Any, ...]) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # the ranks share the machine's cores
    try:
        dist.init_process_group("gloo", init_method=init_method, rank=rank,
                                world_size=world_size, timeout=COLLECTIVE_TIMEOUT)
        results.put((rank, fn(*args)))
    except BaseException:
        results.put((rank, RuntimeError(traceback.format_exc())))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any,
              timeout_s: float = 180.0) -> list[Any]:
    """fn(*args) in every rank of a gloo group; its return values in rank order. A rank that
    raised gives a RuntimeError holding its traceback in its place."""
    from myvllm.executor.tp_workers import pick_init_method

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    init_method = pick_init_method()
    procs = [ctx.Process(target=_rank_main, daemon=True,
                         args=(fn, rank, world_size, init_method, results, args))
             for rank in range(world_size)]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    try:
        while len(out) < world_size:
            # After a failure, the others get a short while: they may wait on the failed one.
            failed = any(isinstance(v, BaseException) for v in out.values())
            try:
                rank, value = results.get(timeout=10.0 if failed else timeout_s)
            except queue.Empty:
                for r in range(world_size):
                    out.setdefault(r, RuntimeError(f"rank {r} gave no result: it hung or died"))
                break
            out[rank] = value
    finally:
        for p in procs:
            p.join(5.0)
            if p.is_alive():
                p.terminate()
                p.join()
    return [out[r] for r in range(world_size)]


def prefill_logits(paths: list[str], prompts: list[list[int]],
                   module: tuple[str, str] | None = None) -> list[dict[str, Any]]:
    """For each checkpoint: this rank's (num_heads, num_kv_heads) of every Attention, and the
    last-token logits of one prefill of the prompts as lists (rank 0; None elsewhere), or
    the error.

    module: (name, file) loaded as that module before the model is built, so the ranks build
    the very class the caller imported (the Llama exercise's grader passes the file it grades).
    """
    import torch
    from helpers_models import prefill_context

    from myvllm.layers.attention import Attention
    from myvllm.models import get_model_class
    from myvllm.utils.context import forward_context
    from myvllm.utils.hf_config import load_hf_config
    from myvllm.utils.loader import load_model

    if module is not None:
        spec = importlib.util.spec_from_file_location(*module)
        assert spec is not None and spec.loader is not None
        sys.modules[module[0]] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[module[0]])
    out = []
    for path in paths:
        config = load_hf_config(path)
        model = get_model_class(config.architectures)(config).eval()
        found: dict[str, Any] = {"heads": [(m.num_heads, m.num_kv_heads) for m in model.modules()
                                           if isinstance(m, Attention)]}
        try:
            load_model(model, path)
            lens = [len(p) for p in prompts]
            ids = torch.tensor([t for p in prompts for t in p])
            positions = torch.cat([torch.arange(n) for n in lens])
            with torch.no_grad(), forward_context(prefill_context(lens)):
                logits = model.compute_logits(model(ids, positions))
            # Plain lists: a tensor would cross the queue as shared memory that this process,
            # exiting at once, could not keep alive for the reader.
            found["logits"] = None if logits is None else logits.tolist()
        except Exception:
            found["error"] = traceback.format_exc()
        out.append(found)
    return out
