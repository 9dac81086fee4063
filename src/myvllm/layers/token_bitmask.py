"""A token bitmask applied to logits: structured outputs' only step on the device.

Row i of the bitmask holds one bit per token id, packed into int32 words (xgrammar's
layout: token t is bit t % 32 of word t // 32); a clear bit sets that logit to -inf, so no
sampling rule can pick the token. structured_output/manager.py fills the bits on the host.
"""

from __future__ import annotations

import torch

_BITS = torch.arange(8, dtype=torch.uint8)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits [B, V]; bitmask [B, words] int32 on the logits' device -> the logits with every
    disallowed token at -inf (a new tensor: the caller's raw logits stay, for logprobs).
    Tokens past the bitmask's width (logits padded beyond the vocabulary) are disallowed."""
    rows, vocab = logits.shape
    if bitmask.shape[0] != rows or bitmask.dtype != torch.int32:
        raise ValueError(f"token bitmask of shape {tuple(bitmask.shape)} ({bitmask.dtype}) for "
                         f"{rows} rows of logits: one int32 row per logits row is needed")
    # Little-endian bytes of an int32 word w hold tokens 32w .. 32w+31 in order, so the
    # bytes of a row, bit by bit, are the tokens in order: one byte per token afterwards.
    as_bytes = bitmask.view(torch.uint8)
    allowed = (as_bytes.unsqueeze(-1) >> _BITS.to(logits.device)) & 1
    allowed = allowed.view(rows, -1).bool()
    width = allowed.shape[1]
    if width < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - width), value=False)
    return logits.masked_fill(~allowed[:, :vocab], float("-inf"))
