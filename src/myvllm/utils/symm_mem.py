"""The tensor-parallel all-reduce over torch's symmetric memory, for the small messages.

NCCL's all-reduce pays a fixed cost per call (measured on two H200s, inside a CUDA graph: 28.4
us for 256 x 4096 bf16), and a decode step of Qwen3-8B makes 73 of them: 24% of a full-batch
step at tensor_parallel_size 2. With symmetric memory every rank maps its peers' buffers
(over NVLink), so one kernel reads the others' partial sums directly: torch's two-shot
all-reduce took 16.6 us for the same message. Each rank:

    x (its partial sum)  --copy-->  its symmetric buffer
    two_shot_all_reduce_out: reduce 1/N of the elements over all N buffers, then gather the
                             reduced pieces into x (every rank ends with the sum)

one_shot_all_reduce_copy_out does it in one kernel (each rank reads every buffer whole): for
the smallest messages, where latency is all there is.

The buffer is allocated and exchanged (rendezvous, a collective) once, when the process group
is created, before any CUDA graph is captured: the kernels captured in a graph then read the
same buffers at every replay. Multicast (NVLink SHARP, torch's multimem_* ops) is never used,
and torch is told not to create multicast objects at all (TORCH_SYMM_MEM_DISABLE_MULTICAST).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

# Message sizes (bytes) up to which each kernel beats NCCL's all-reduce; larger messages go
# to NCCL. From the one measurement there is (two H200s, 256 x 4096 bf16 = 2 MiB, in a CUDA
# graph: two-shot 16.6 us, NCCL 28.4 us); benchmarks/benchmark_all_reduce.py measures every
# size from 1 to 256 rows and prints the table to put here.
ONE_SHOT_MAX_BYTES = 0  # not measured yet: off
TWO_SHOT_MAX_BYTES = 2 * 2**20
# torch's kernels: bf16 and fp32 only; world sizes 2, 4 and 8 only (two_shot_all_reduce_out).
SUPPORTED_DTYPES = (torch.bfloat16, torch.float32)
SUPPORTED_WORLD_SIZES = (2, 4, 8)
ALIGNMENT_BYTES = 16  # the kernels' widest vector; smaller multiples run slower paths


class SymmMemAllReduce:
    """One symmetric buffer of max_bytes on this rank's GPU, exchanged with every rank of the
    default group; all_reduce(x) sums x over the ranks in place through it."""

    def __init__(self, device: torch.device, max_bytes: int = TWO_SHOT_MAX_BYTES,
                 one_shot_max_bytes: int = ONE_SHOT_MAX_BYTES) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        self.max_bytes = max_bytes
        self.one_shot_max_bytes = one_shot_max_bytes
        self.group_name = dist.group.WORLD.group_name  # type: ignore[union-attr]
        self.buffer = symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)
        # A collective: every rank maps every other rank's buffer. Host-blocking, never in a
        # graph, so here and only here.
        symm_mem.rendezvous(self.buffer, self.group_name)

    def fits(self, x: torch.Tensor) -> bool:
        """Whether x can go through the buffer (else: NCCL)."""
        nbytes = x.numel() * x.element_size()
        return (x.dtype in SUPPORTED_DTYPES and x.is_contiguous() and 0 < nbytes
                and nbytes <= self.max_bytes and nbytes % ALIGNMENT_BYTES == 0)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place (the caller checked fits(x))."""
        flat = x.view(-1)
        staged = self.buffer[: flat.numel() * flat.element_size()].view(x.dtype)
        if flat.numel() * flat.element_size() <= self.one_shot_max_bytes:
            torch.ops.symm_mem.one_shot_all_reduce_copy_out(staged, flat, "sum",
                                                            self.group_name, flat)
        else:
            staged.copy_(flat)
            torch.ops.symm_mem.two_shot_all_reduce_out(staged, "sum", self.group_name, flat)
        return x


def symm_mem_unavailable_reason(device: torch.device, world_size: int,
                                ranks_on_this_host: int) -> str | None:
    """Why this group cannot use symmetric memory, or None when it can."""
    if device.type != "cuda":
        return "not on a GPU"
    if world_size not in SUPPORTED_WORLD_SIZES:
        return f"torch's kernels take {SUPPORTED_WORLD_SIZES} ranks, not {world_size}"
    if ranks_on_this_host != world_size:
        return "the ranks span several hosts (symmetric memory maps GPUs of one host)"
    try:
        import torch.distributed._symmetric_memory  # noqa: F401  (registers the ops)
    except ImportError as e:
        return f"this torch has no symmetric memory ({e})"
    if not hasattr(torch.ops.symm_mem, "two_shot_all_reduce_out"):
        return f"torch {torch.__version__} has no two_shot_all_reduce_out"
    return None
