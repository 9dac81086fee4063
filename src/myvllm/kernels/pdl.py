"""Programmatic dependent launch (PDL): the next kernel starts while this one finishes.

A decode step of Qwen3-0.6B at batch 1 is about 235 kernels of 1-5 microseconds each: 8 per
decoder layer over 28 layers (the norm+qkv_proj matmul, norm+RoPE, store_kvcache, the two
decode-attention kernels, o_proj, the norm+gate_up_proj matmul, the SiLU+down_proj matmul),
plus the embedding, the final norm, the LM head, sampling and a few small copies (counted in
the batch-1 profile of docs/raw/2026-11-30c-h200-tps-final-code-1.log). Between two kernels
of a CUDA graph the GPU idles while the first one's last programs drain and the second one's
programs are launched. On Hopper and later GPUs a kernel launched with PDL may start before
the kernel ahead of it in the stream has finished:

    without PDL   kernel A  ########--|                     (-- : A's last programs drain,
                                       kernel B  #######       then B is launched)
    with PDL      kernel A  ########--|
                          kernel B  ..wait|#######         (B launched early, waits for A)

Each decode-path kernel of ours is launched with `**pdl_args(tensor)` (USE_PDL and
`launch_pdl=True`) and calls
pdl_wait first: `gdc_wait` returns once the previous kernel has completed and its writes are
visible, and `gdc_launch_dependents` lets the next kernel launch. Before the wait a kernel may
only read what no earlier kernel writes: skinny_gemm loads its first tile of weights there, so
the weight stream starts while the previous kernel finishes. After the wait everything is
ordered as without PDL, so results do not change; a kernel that is not launched with PDL
(cuBLAS, PyTorch's) simply runs after its predecessor as usual.

Only for launches over at most PDL_MAX_ROWS rows (tokens or sequences). PDL pays where a step
is a chain of tiny kernels: at batch 1 it took decode from 0.99 to 0.74-0.84 ms per token on
the H200, while at batch 256, where one long attention kernel dominates, it cost ~1.5% of
throughput (docs/benchmarks.md). Also off on a CPU (the interpreter), before Hopper, and when
MYVLLM_PDL=0. Whether a launch uses PDL never changes its result.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl


@functools.cache
def _device_supports_pdl(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


# The launch-bound regime: decode batches up to 8 (the CUDA-graph sizes 1, 2, 4, 8, where
# skinny_gemm serves the matmuls). Measured at 1 and 256 only; 8 is a judgement, not a sweep.
PDL_MAX_ROWS = 8


def pdl_wanted(num_rows: int) -> bool:
    """PDL for a launch over num_rows rows (tokens, sequences), given a GPU that has it."""
    return num_rows <= PDL_MAX_ROWS and os.environ.get("MYVLLM_PDL", "1") != "0"


def pdl_enabled(tensor: torch.Tensor) -> bool:
    """Launch a kernel over this tensor (rows = its first dimension) with PDL?"""
    return (tensor.is_cuda and pdl_wanted(tensor.shape[0])
            and _device_supports_pdl(tensor.device.index or 0))


def pdl_launch_args(use_pdl: bool) -> dict[str, bool]:
    """Extra launch arguments: {"launch_pdl": True} with PDL, else none (the CPU
    interpreter's launcher knows no such argument)."""
    return {"launch_pdl": True} if use_pdl else {}


def pdl_args(tensor: torch.Tensor) -> dict[str, bool]:
    """A kernel launch's PDL arguments: its USE_PDL constexpr, and launch_pdl when on."""
    use_pdl = pdl_enabled(tensor)
    return {"USE_PDL": use_pdl, **pdl_launch_args(use_pdl)}


@triton.jit
def pdl_wait(USE_PDL: tl.constexpr):
    """Wait for the previous kernel (and its writes), then let the next kernel launch."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
