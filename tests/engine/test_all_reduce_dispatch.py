"""The row-parallel layers' one all-reduce (utils/distributed.py all_reduce): on a CPU it is
gloo's, with the sum unchanged; which messages the symmetric-memory kernel would take; when it
cannot run, and the log line that says why. The kernel itself needs two GPUs:
tests/gpu/test_gpu_all_reduce.py.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from helpers_tp_ranks import run_ranks

from myvllm import Config
from myvllm.utils import distributed
from myvllm.utils.symm_mem import SymmMemAllReduce, symm_mem_unavailable_reason


def reduce_on_rank(enable: bool) -> dict[str, Any]:
    """In a gloo rank: set the all-reduce up, then sum what the layers sum."""
    import torch.distributed as dist

    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("myvllm")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    distributed.init_all_reduce(torch.device("cpu"), enable=enable)
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(rank)
    partial = torch.randn(3, 64, generator=gen)
    summed = distributed.all_reduce(partial.clone())
    distributed.release_all_reduce()
    logger.removeHandler(handler)  # the next setting's lines are its own
    # Lists, not tensors: a tensor crosses the queue as shared memory its rank must outlive.
    return {"kind": distributed.all_reduce_kind(), "partial": partial.tolist(),
            "summed": summed.tolist(), "log": records}


def reduce_on_rank_each_setting() -> dict[bool, dict[str, Any]]:
    """reduce_on_rank with the kernel allowed, then disabled, in the same two ranks (each pair
    of spawned ranks imports torch twice: seconds on a 2-core CPU)."""
    return {enable: reduce_on_rank(enable) for enable in (True, False)}


@pytest.fixture(scope="module")
def results_by_setting() -> dict[bool, list[Any]]:
    """{enable: every rank's result of reduce_on_rank(enable)}; a failed rank's error in place
    of its results."""
    ranks = run_ranks(reduce_on_rank_each_setting, 2)
    return {enable: [rank if isinstance(rank, BaseException) else rank[enable]
                     for rank in ranks] for enable in (True, False)}


@pytest.mark.slow  # two spawned ranks
@pytest.mark.parametrize("enable", [True, False], ids=["auto", "disabled"])
def test_gloo_sums_every_message_and_says_so(results_by_setting: dict[bool, list[Any]],
                                             enable: bool) -> None:
    results = results_by_setting[enable]
    for result in results:
        assert not isinstance(result, BaseException), result
    expected = torch.tensor(results[0]["partial"]) + torch.tensor(results[1]["partial"])
    for result in results:
        assert result["kind"] == "nccl/gloo only"
        assert torch.equal(torch.tensor(result["summed"]), expected)  # two addends: one order
    reason = "not on a GPU" if enable else "disable_custom_all_reduce=True"
    assert results[0]["log"] == [f"tensor-parallel all-reduce: gloo for every message "
                                 f"({reason})"]
    assert results[1]["log"] == []  # one line, from rank 0


def test_one_rank_needs_no_group() -> None:
    """Without a process group the layers never call all_reduce (tp_size 1): nothing set up."""
    assert distributed.all_reduce_kind() == "nccl/gloo only"


def symm_mem_of(max_bytes: int) -> SymmMemAllReduce:
    """The size rules of a SymmMemAllReduce, without GPUs (no buffer, no rendezvous)."""
    kernel = SymmMemAllReduce.__new__(SymmMemAllReduce)
    kernel.max_bytes = max_bytes
    return kernel


@pytest.mark.parametrize("shape, dtype, fits", [
    ((256, 4096), torch.bfloat16, True),     # 2 MiB: a decode step of the 8B shape
    ((1, 4096), torch.bfloat16, True),
    ((1, 4096), torch.float32, True),
    ((257, 4096), torch.bfloat16, False),    # over the buffer: NCCL
    ((1, 4096), torch.float16, False),       # torch's kernels take bf16 and fp32 only
    ((1, 7), torch.bfloat16, False),         # 14 bytes: not a multiple of 16
    ((0, 4096), torch.bfloat16, False),
])
def test_which_messages_symmetric_memory_takes(shape: tuple[int, int], dtype: torch.dtype,
                                               fits: bool) -> None:
    kernel = symm_mem_of(2 * 2**20)
    assert kernel.fits(torch.empty(shape, dtype=dtype)) is fits
    if fits and shape[0] > 1:
        assert not kernel.fits(torch.empty(shape, dtype=dtype).t())  # not contiguous


def test_dispatch_sends_only_fitting_messages_to_symmetric_memory(
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []

    class Recording(SymmMemAllReduce):
        def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
            calls.append(f"symm {tuple(x.shape)}")
            return x.mul_(2)  # what two ranks holding the same x would sum to

    kernel = Recording.__new__(Recording)
    kernel.max_bytes = 1024
    monkeypatch.setattr(distributed, "_symm_mem", kernel)
    monkeypatch.setattr(distributed.dist, "all_reduce",
                        lambda x: calls.append(f"nccl {tuple(x.shape)}"))
    small, large = torch.ones(4, 64), torch.ones(8, 64)  # 1 KiB and 2 KiB of fp32
    assert distributed.all_reduce(small) is small and torch.equal(small, torch.full((4, 64), 2.0))
    distributed.all_reduce(large)
    assert calls == ["symm (4, 64)", "nccl (8, 64)"]


@pytest.mark.parametrize("device, world, here, reason", [
    ("cpu", 2, 2, "not on a GPU"),
    ("cuda", 3, 3, "torch's kernels take (2, 4, 8) ranks, not 3"),
    ("cuda", 2, 1, "the ranks span several hosts"),
])
def test_when_symmetric_memory_cannot_run(device: str, world: int, here: int,
                                          reason: str) -> None:
    assert reason in (symm_mem_unavailable_reason(torch.device(device), world, here) or "")


def test_the_switch_is_a_checked_config_field() -> None:
    assert Config().disable_custom_all_reduce is True  # opt-in until measured on two GPUs
    with pytest.raises(ValueError, match="disable_custom_all_reduce='yes': allowed: True or False"):
        Config(disable_custom_all_reduce="yes")  # type: ignore[arg-type]
