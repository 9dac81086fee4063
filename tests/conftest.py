"""Shared pytest setup. pytest imports this file before any test module, so what it sets holds
for every test whatever the order in which the tests run:

- On a machine without CUDA, TRITON_INTERPRET=1 for the whole run, set here before anything
  imports triton. Triton reads the flag when a function is decorated with @triton.jit (its own
  library functions at `import triton`, ours when their module is imported) and cannot switch
  later in the process, so it must be set before the first import, whichever test file comes
  first. tests/kernels/test_kernels.py then runs our Triton kernels in Triton's CPU
  interpreter. Nothing else changes: on CPU tensors the engine calls the PyTorch reference
  kernels (kernels.use_triton) unless a test forces Triton with MYVLLM_FORCE_TRITON=1.
  Subprocesses that tests start inherit the flag, with the same effect. (If something imported
  triton before this file ran, the kernel tests fail and say so.)
- Every test starts from torch.manual_seed(0), so the random inputs of a test that does not
  seed torch itself do not depend on which tests ran before it.
- Every test starts with batch-invariant mode off. The mode is a flag of the process
  (kernels/batch_invariant.py) that an engine built with Config.batch_invariant=True leaves on;
  an engine sets its own mode again at each step, but a test that calls a kernel directly
  would otherwise take the invariant path after such an engine's test (on the H100 the decode
  kernel's switch test did, in the whole GPU suite only).

tests/ and the repository root are on sys.path through pyproject's [tool.pytest.ini_options]
pythonpath (for `from helpers_models import ...` and `from benchmarks.baselines import ...`).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture(autouse=True)
def _seed_torch() -> None:
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _batch_invariant_off() -> None:
    from myvllm.kernels import set_batch_invariant

    set_batch_invariant(False)
