"""Tensor-parallel rank and world size, read from torch.distributed; the all-reduce and the
gather the layers call; how torchrun started us.

Layers call get_tp_rank / get_tp_size at construction time to decide which shard of each
weight they own, and whether they sum or gather over the ranks at all (with one rank a
forward calls nothing here). Without an initialised process group we are a single rank
(rank 0 of 1), so the model classes work unchanged in plain single-process use and in tests.

all_reduce(x) is the one all-reduce of the row-parallel layers: torch's symmetric-memory
kernel for the messages it is measured to win (utils/symm_mem.py), NCCL (gloo on a CPU) for
the others. init_all_reduce, which every rank calls once its process group exists, decides.

torchrun_env() reads the variables torchrun sets in every process it starts (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT): then every rank, on every host, is a
process of its own that torchrun started, instead of a worker the engine spawned
(executor/tp_launch.py).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from myvllm.utils.symm_mem import SymmMemAllReduce, symm_mem_unavailable_reason

logger = logging.getLogger("myvllm")

# Any of these set means torchrun (or a launcher that speaks its protocol) started us.
TORCHRUN_RANK_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
TORCHRUN_VARS = TORCHRUN_RANK_VARS + ("MASTER_ADDR", "MASTER_PORT")


def get_tp_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def get_tp_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


# This process's symmetric-memory all-reduce, or None (NCCL / gloo for every message).
_symm_mem: SymmMemAllReduce | None = None


def all_reduce(x: torch.Tensor, in_rank_order: bool = False) -> torch.Tensor:
    """Sum x over the tensor-parallel ranks, in place; returns x. Inside a CUDA graph too:
    either kernel is captured as it is launched.

    in_rank_order (batch-invariant mode, kernels/batch_invariant.py): NCCL picks its
    all-reduce algorithm and protocol (ring, tree; how the sum is chunked) by message size,
    that is by the batch, and with them the order of the sum. So the ranks' tensors are
    gathered (a copy, exact) and added here in rank order, the same order for every row at
    every batch size."""
    if in_rank_order:
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, x)
        total = parts[0]
        for part in parts[1:]:
            total += part  # rank 0 + rank 1 + ... elementwise: one order whatever the shape
        return x.copy_(total)
    if _symm_mem is not None and _symm_mem.fits(x):
        return _symm_mem.all_reduce(x)
    dist.all_reduce(x)
    return x


def gather_on_rank0(x: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor | None:
    """The ranks' x side by side along the last dim on rank 0, None on the others (the LM
    head's logits: only rank 0 samples). One rank: x itself."""
    if tp_size == 1:
        return x
    gathered = [torch.empty_like(x) for _ in range(tp_size)] if tp_rank == 0 else None
    dist.gather(x, gathered, dst=0)
    if gathered is None:
        return None
    return torch.cat(gathered, dim=-1)


def all_reduce_kind() -> str:
    """"symmetric memory" or "nccl/gloo only": what init_all_reduce chose."""
    return "nccl/gloo only" if _symm_mem is None else "symmetric memory"


def init_all_reduce(device: torch.device, enable: bool) -> None:
    """Every rank, right after its process group is created and before any CUDA graph is
    captured: set up the symmetric-memory all-reduce where it can run. Collective on GPUs
    (the buffers' exchange, then an agreement: one rank that cannot, and none does, or the
    ranks would wait in different kernels). One log line on rank 0 says what was chosen."""
    global _symm_mem
    _symm_mem = None
    world_size = dist.get_world_size()
    env = torchrun_env()
    ranks_here = world_size if env is None else env.local_world_size
    reason = ("disable_custom_all_reduce=True" if not enable
              else symm_mem_unavailable_reason(device, world_size, ranks_here))
    candidate = None
    if reason is None:
        try:
            candidate = SymmMemAllReduce(device)
        except Exception as e:  # e.g. GPUs that cannot map each other's memory
            reason = f"symmetric memory failed to start on rank {dist.get_rank()}: {e}"
            logger.warning(reason)
    if device.type == "cuda":  # the choices could differ by rank only here
        agreed = torch.tensor([int(candidate is not None)], dtype=torch.int32, device=device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
        if int(agreed.item()) == 0:
            candidate = None
            reason = reason or "another rank could not start symmetric memory"
    _symm_mem = candidate
    if dist.get_rank() == 0 and world_size > 1:
        if candidate is not None:
            logger.info(f"tensor-parallel all-reduce: symmetric memory (torch's two-shot "
                        f"kernel) up to {candidate.max_bytes // 1024} KiB a message, NCCL "
                        f"above")
        else:
            backend = "NCCL" if device.type == "cuda" else "gloo"
            logger.info(f"tensor-parallel all-reduce: {backend} for every message ({reason})")


def release_all_reduce() -> None:
    """Before the process group is destroyed (and after the CUDA graphs that read its
    buffer are dropped): forget the symmetric buffer."""
    global _symm_mem
    _symm_mem = None


@dataclass(frozen=True)
class TorchrunEnv:
    """One process's place in a torchrun launch: one process per tensor-parallel rank."""

    rank: int          # 0 runs the engine; 1..world_size-1 serve its calls
    world_size: int    # every rank on every host
    local_rank: int    # this host's GPU index (cuda:local_rank)
    master_addr: str   # the host of rank 0 (node rank 0) and of torchrun's store
    master_port: int
    local_world_size: int  # ranks on this host (0: not said; taken as fewer than all)


def torchrun_env() -> TorchrunEnv | None:
    """The torchrun launch this process is part of, or None when torchrun did not start it.

    A partial or malformed set of variables is an error naming them: guessing a rank would
    join the wrong process group, or hang in it.
    """
    if not any(name in os.environ for name in TORCHRUN_RANK_VARS):
        return None
    missing = [name for name in TORCHRUN_VARS if not os.environ.get(name)]
    if missing:
        raise ValueError(f"torchrun's environment is incomplete: {', '.join(missing)} not set "
                         f"(a process started by torchrun has all of {', '.join(TORCHRUN_VARS)}"
                         "); unset RANK, WORLD_SIZE and LOCAL_RANK to run without torchrun")
    values = {name: _env_int(name) for name in TORCHRUN_RANK_VARS + ("MASTER_PORT",)}
    env = TorchrunEnv(rank=values["RANK"], world_size=values["WORLD_SIZE"],
                      local_rank=values["LOCAL_RANK"], master_addr=os.environ["MASTER_ADDR"],
                      master_port=values["MASTER_PORT"],
                      local_world_size=(_env_int("LOCAL_WORLD_SIZE")
                                        if os.environ.get("LOCAL_WORLD_SIZE") else 0))
    if env.world_size < 1 or not 0 <= env.rank < env.world_size:
        raise ValueError(f"torchrun's environment is inconsistent: RANK={env.rank} must be in "
                         f"[0, WORLD_SIZE={env.world_size})")
    if env.local_rank < 0 or env.local_rank > env.rank:
        raise ValueError(f"torchrun's environment is inconsistent: LOCAL_RANK={env.local_rank} "
                         f"must be in [0, RANK={env.rank}]")
    if not 1 <= env.master_port <= 65535:
        raise ValueError(f"MASTER_PORT={env.master_port} is not a TCP port (1..65535)")
    return env


def check_torchrun_world_size(env: TorchrunEnv | None, tensor_parallel_size: int) -> None:
    """Every process torchrun starts is one tensor-parallel rank: their counts must agree."""
    if env is not None and env.world_size != tensor_parallel_size:
        raise ValueError(f"torchrun started WORLD_SIZE={env.world_size} processes but "
                         f"tensor_parallel_size is {tensor_parallel_size}: each process is one "
                         f"tensor-parallel rank, so pass --tensor-parallel-size "
                         f"{env.world_size}, or start as many processes as ranks (--nnodes x "
                         f"--nproc-per-node = {tensor_parallel_size})")


def local_device_index(rank: int) -> int:
    """The GPU of this rank on its host: LOCAL_RANK under torchrun (ranks spread over hosts),
    else the rank itself (the engine spawned every rank on this host)."""
    env = torchrun_env()
    return rank if env is None else env.local_rank


def _env_int(name: str) -> int:
    text = os.environ[name]
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{name}={text!r} must be an integer (torchrun sets it)") from None
