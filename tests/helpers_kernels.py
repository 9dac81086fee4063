"""What the kernel tests share: the dtypes they run in and how far Triton may be from the
torch reference on the same inputs (accumulation order only).

bf16 only on a GPU: Triton's CPU interpreter computes bf16 dot products wrongly."""

from __future__ import annotations

import torch

HAS_CUDA = torch.cuda.is_available()
DTYPES = [torch.float16, torch.float32] + ([torch.bfloat16] if HAS_CUDA else [])
TOL = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}
