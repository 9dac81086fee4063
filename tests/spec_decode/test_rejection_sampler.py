"""Rejection sampling against distributions known in closed form (torch only, quick).

Each test puts the same target logits in many rows, so one call is many independent draws;
a chi-square test then compares the emitted tokens' frequencies with the target p. The
critical values are chi-square's 0.999 quantiles: a correct sampler fails one run in a
thousand, a wrong one (say the residual left as p instead of max(0, p - q)) fails always:
it moves a token's frequency by tens of standard deviations here.
"""

from __future__ import annotations

import pytest
import torch

from myvllm.spec_decode.rejection_sampler import PLACEHOLDER, rejection_sample

V = 5
CHI2_999 = {4: 18.47, 2: 13.82}  # 0.999 quantiles by degrees of freedom
DRAWS = 20_000


def chi_square(tokens: torch.Tensor, p: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=p.numel()).double()
    expected = p.double() * tokens.numel()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was emitted"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def targets(seed: int, width: int) -> torch.Tensor:
    """width distributions over V tokens, none nearly 0 or 1."""
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(width, V, generator=g), dim=-1)


def test_ngram_proposals_keep_the_target_distribution() -> None:
    """q one-hot (prompt lookup): the first token is distributed as p_1, the second, given
    the first proposal accepted, as p_2, and so on; all accepted, the bonus as p_4."""
    torch.manual_seed(0)
    p = targets(1, 4)
    drafts = p[:3].argmax(dim=-1)  # likely ones, so that many rows get far
    out = rejection_sample(p.log().expand(DRAWS, 4, V), drafts.expand(DRAWS, 3),
                           [3] * DRAWS, torch.ones(DRAWS))
    assert chi_square(out[:, 0], p[0]) < CHI2_999[4]
    for j in range(1, 4):
        # Rows that accepted proposals 0..j-1 emit a token at position j, drawn from p_j.
        accepted = (out[:, :j] == drafts[:j]).all(dim=1) & (out[:, j] != PLACEHOLDER)
        assert accepted.sum() > 500
        assert chi_square(out[accepted, j], p[j]) < CHI2_999[4]
    # A row emits its accepted proposals and exactly one more token, then placeholders.
    emitted = (out != PLACEHOLDER).sum(dim=1)
    assert bool(((out[:, :] != PLACEHOLDER).long().cumprod(dim=1).sum(dim=1) == emitted).all())
    # Acceptance of proposal 0 happens with probability p_1(d_0).
    d0 = float(p[0, drafts[0]])
    rate = float(((out[:, 0] == drafts[0]) & (out[:, 1] != PLACEHOLDER)).double().mean())
    assert abs(rate - d0) < 4 * (d0 * (1 - d0) / DRAWS) ** 0.5


def test_draft_model_proposals_keep_the_target_distribution() -> None:
    """q a full distribution (a draft model), proposals drawn from q: accept with
    min(1, p/q), else draw from norm(max(0, p - q)); the result is p."""
    torch.manual_seed(0)
    p = targets(2, 3)
    q = targets(3, 2)
    drafts = torch.stack([torch.multinomial(q[j], DRAWS, replacement=True) for j in range(2)],
                         dim=1)
    out = rejection_sample(p.log().expand(DRAWS, 3, V), drafts, [2] * DRAWS,
                           torch.ones(DRAWS), draft_probs=q.expand(DRAWS, 2, V))
    assert chi_square(out[:, 0], p[0]) < CHI2_999[4]
    accepted = (out[:, 0] == drafts[:, 0]) & (out[:, 1] != PLACEHOLDER)
    assert chi_square(out[accepted, 1], p[1]) < CHI2_999[4]


def test_temperature_and_top_k_shape_p() -> None:
    """p is softmax(logits / T) within the top-k, as the Sampler draws it."""
    torch.manual_seed(0)
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(4))
    temperature, top_k = 0.7, 3
    kept = logits[0].topk(top_k).indices
    p = torch.zeros(V)
    p[kept] = torch.softmax(logits[0, kept] / temperature, dim=-1)
    draft = int(kept[1])
    out = rejection_sample(logits.expand(DRAWS, 2, V), torch.full((DRAWS, 1), draft), [1] * DRAWS,
                           torch.full((DRAWS,), temperature),
                           top_ks=torch.full((DRAWS,), top_k))
    assert chi_square(out[:, 0], p) < CHI2_999[2]


def test_greedy_rows_accept_exactly_the_argmax() -> None:
    logits = torch.randn(3, 4, V, generator=torch.Generator().manual_seed(5))
    argmax = logits.argmax(dim=-1)
    wrong = (argmax + 1) % V
    drafts = torch.stack([argmax[0, :3],  # all right: three accepted and the bonus
                          torch.cat([argmax[1, :1], wrong[1, 1:3]]),  # one right, then wrong
                          wrong[2, :3]])
    for all_greedy in (True, False):  # the batch's fast path, and greedy rows among others
        out = rejection_sample(logits, drafts, [3, 3, 2], torch.zeros(3), all_greedy=all_greedy)
        assert out[0].tolist() == argmax[0].tolist()
        assert out[1].tolist() == [int(argmax[1, 0]), int(argmax[1, 1]), PLACEHOLDER,
                                   PLACEHOLDER]
        assert out[2].tolist() == [int(argmax[2, 0]), PLACEHOLDER, PLACEHOLDER, PLACEHOLDER]


def test_seeded_rows_repeat_and_ignore_their_neighbours() -> None:
    logits = torch.randn(1, 3, V, generator=torch.Generator().manual_seed(6))
    drafts = logits[0, :2].argmax(dim=-1).unsqueeze(0)

    def run(batch: int, row: int) -> list[int]:
        generators = [torch.Generator().manual_seed(100 + i) for i in range(batch)]
        generators[row] = torch.Generator().manual_seed(7)
        out = rejection_sample(logits.expand(batch, 3, V), drafts.expand(batch, 2), [2] * batch,
                               torch.ones(batch), generators=generators)
        return out[row].tolist()

    assert run(1, 0) == run(4, 2) == run(8, 5)


def test_bad_shapes_are_refused() -> None:
    logits = torch.zeros(2, 3, V)
    with pytest.raises(ValueError, match="draft_token_ids"):
        rejection_sample(logits, torch.zeros(2, 3, dtype=torch.int64), [2, 2], torch.ones(2))
    with pytest.raises(ValueError, match="num_draft_tokens"):
        rejection_sample(logits, torch.zeros(2, 2, dtype=torch.int64), [3, 0], torch.ones(2))
