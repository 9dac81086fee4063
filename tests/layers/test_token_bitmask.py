"""The token bitmask on the logits (layers/token_bitmask.py), against xgrammar's own
apply_token_bitmask_inplace as the oracle, and inside the Sampler on every path."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import xgrammar as xgr

from myvllm.layers.sampler import Sampler
from myvllm.layers.token_bitmask import apply_token_bitmask


def random_bitmask(rows: int, vocab: int, seed: int, density: float = 0.3) -> torch.Tensor:
    """xgrammar's layout from a random boolean mask (each row keeps one token at least)."""
    gen = torch.Generator().manual_seed(seed)
    allowed = torch.rand(rows, vocab, generator=gen) < density
    allowed[torch.arange(rows), torch.randint(0, vocab, (rows,), generator=gen)] = True
    bitmask = xgr.allocate_token_bitmask(rows, vocab)
    padded = np.zeros((rows, bitmask.shape[1] * 32), dtype=bool)
    padded[:, :vocab] = allowed.numpy()
    # Token t is bit t % 32 of int32 word t // 32: little-endian bits, bytes and words.
    words = np.packbits(padded, axis=-1, bitorder="little").view("<i4")
    bitmask.copy_(torch.from_numpy(words.astype(np.int32)))
    return bitmask


@pytest.mark.parametrize("vocab", [31, 32, 33, 100, 256])
def test_the_mask_matches_xgrammar(vocab: int) -> None:
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(vocab))
    bitmask = random_bitmask(5, vocab, seed=vocab)
    expected = logits.clone()
    xgr.apply_token_bitmask_inplace(expected, bitmask)
    got = apply_token_bitmask(logits, bitmask)
    assert torch.equal(got, expected)
    assert not torch.isinf(logits).any()  # the caller's logits are left as they were


def test_logits_wider_than_the_bitmask_mask_the_extra_ids() -> None:
    """Padding past the vocabulary the bitmask describes (here 64 ids, 80 logits)."""
    bitmask = torch.full((2, 2), -1, dtype=torch.int32)  # all 64 allowed
    got = apply_token_bitmask(torch.zeros(2, 80), bitmask)
    assert torch.isfinite(got[:, :64]).all() and torch.isinf(got[:, 64:]).all()


def test_a_bad_bitmask_is_refused() -> None:
    with pytest.raises(ValueError, match="one int32 row per logits row"):
        apply_token_bitmask(torch.zeros(3, 64), torch.zeros(2, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="one int32 row per logits row"):
        apply_token_bitmask(torch.zeros(2, 64), torch.zeros(2, 2, dtype=torch.int64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_every_sampler_path_picks_allowed_tokens_only(dtype: torch.dtype) -> None:
    """Greedy, temperature, top-k, top-p, seeded: each token is one the bitmask allows, and
    a row allowed everything samples as without a bitmask."""
    rows, vocab = 8, 300
    logits = (torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)) * 4
              ).to(dtype)
    bitmask = random_bitmask(rows, vocab, seed=1, density=0.05)
    bitmask[0] = -1
    allowed = torch.isfinite(apply_token_bitmask(torch.zeros(rows, vocab), bitmask))
    sampler = Sampler()
    temps = torch.tensor([0.0, 0.0, 0.7, 1.0, 1.5, 1.0, 2.0, 1.0])
    for kwargs in [dict(all_greedy=True), {}, dict(top_ks=torch.full((rows,), 5)),
                   dict(top_ps=torch.full((rows,), 0.5)),
                   dict(generators=[torch.Generator().manual_seed(i) for i in range(rows)])]:
        for _ in range(5):
            t = temps.zero_() if kwargs.get("all_greedy") else temps
            tokens = sampler(apply_token_bitmask(logits, bitmask), t, **kwargs)
            assert allowed[torch.arange(rows), tokens].all(), kwargs
    greedy = sampler(apply_token_bitmask(logits, bitmask), torch.zeros(rows), all_greedy=True)
    assert greedy[0] == logits[0].float().argmax()
    masked = logits.float().masked_fill(~allowed, float("-inf"))
    assert torch.equal(greedy, masked.argmax(-1))
