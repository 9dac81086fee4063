"""Sampler: greedy exactness, filters, per-request seeds, and the sampled distribution."""

from __future__ import annotations

import pytest
import torch

from myvllm.layers.sampler import Sampler

sampler = Sampler()


def _rows(batch: int, value: float, dtype=torch.float32) -> torch.Tensor:
    return torch.full((batch,), value, dtype=dtype)


def test_greedy_is_argmax() -> None:
    logits = torch.randn(6, 100)
    out = sampler(logits, _rows(6, 0.0), all_greedy=True)
    assert out.dtype == torch.int64
    assert torch.equal(out, logits.argmax(-1))
    # Through the sampling path (all_greedy=False, filters present) greedy rows stay exact.
    out = sampler(logits, _rows(6, 0.0), torch.full((6,), 5), _rows(6, 0.5), all_greedy=False)
    assert torch.equal(out, logits.argmax(-1))


def test_mixed_batch_greedy_rows_exact() -> None:
    logits = torch.randn(8, 50)
    temps = torch.tensor([0.0, 1.0] * 4)
    for _ in range(5):
        out = sampler(logits, temps)
        assert torch.equal(out[::2], logits[::2].argmax(-1))


@pytest.mark.parametrize("temperature", [0.5, 1.0, 10.0])
def test_top_k_1_is_argmax(temperature: float) -> None:
    logits = torch.randn(16, 200)
    out = sampler(logits, _rows(16, temperature), torch.ones(16, dtype=torch.int64), None)
    assert torch.equal(out, logits.argmax(-1))


def test_tiny_top_p_is_argmax() -> None:
    logits = torch.randn(16, 200)
    out = sampler(logits, _rows(16, 2.0), None, _rows(16, 1e-6))
    assert torch.equal(out, logits.argmax(-1))


def test_top_k_only_samples_from_the_k_best() -> None:
    logits = torch.randn(4, 50)
    top3 = logits.topk(3, dim=-1).indices
    for _ in range(50):
        out = sampler(logits, _rows(4, 5.0), torch.full((4,), 3), None)
        assert (top3 == out[:, None]).any(-1).all()


def test_top_p_keeps_smallest_set_reaching_p() -> None:
    # probs 0.5, 0.3, 0.15, 0.05: top_p 0.7 keeps {0, 1} (0.5 < 0.7, 0.8 >= 0.7).
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(200, 1)
    out = sampler(logits, _rows(200, 1.0), None, _rows(200, 0.7))
    assert set(out.tolist()) == {0, 1}


def test_seeded_rows_reproducible_and_batch_independent() -> None:
    logits = torch.randn(5, 1000)
    temps = _rows(5, 1.0)

    def gen(seed: int) -> torch.Generator:
        return torch.Generator().manual_seed(seed)

    alone = sampler(logits[2:3], temps[:1], generators=[gen(42)])
    # Same row, same seed, in a batch with other (seeded and unseeded) rows and filters on.
    batch = sampler(
        logits, temps, torch.tensor([-1, 5, -1, 0, 2]), torch.tensor([1.0, 0.9, 1.0, 1.0, 0.5]),
        generators=[None, gen(1), gen(42), None, gen(7)],
    )  # fmt: skip
    assert batch[2] == alone[0]
    # A sequence of steps with one generator repeats exactly.
    g1, g2 = gen(3), gen(3)
    steps1 = [sampler(logits, temps, generators=[g1] * 5).tolist() for _ in range(3)]
    steps2 = [sampler(logits, temps, generators=[g2] * 5).tolist() for _ in range(3)]
    assert steps1 == steps2
    # Different seeds give different draws somewhere (1000-way choice, 5 rows).
    assert (
        sampler(logits, temps, generators=[gen(1)] * 5).tolist()
        != sampler(logits, temps, generators=[gen(2)] * 5).tolist()
    )


def test_temperature_sampling_matches_softmax() -> None:
    torch.manual_seed(0)
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, 0.5])
    temperature = 0.7
    n = 20000
    out = sampler(logits.repeat(n, 1), _rows(n, temperature), generators=None)
    freq = torch.bincount(out, minlength=5).float() / n
    expected = torch.softmax(logits / temperature, dim=-1)
    # Standard error is at most 0.0036 here; 0.02 is > 5 sigma.
    torch.testing.assert_close(freq, expected, atol=0.02, rtol=0)


def test_unseeded_rows_beside_a_seeded_one_match_softmax() -> None:
    """A batch with one seeded row: the other rows' noise is drawn once, from torch's
    generator, and still gives the softmax distribution."""
    torch.manual_seed(2)
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, 0.5])
    n = 20000
    generators = [torch.Generator().manual_seed(0)] + [None] * (n - 1)
    out = sampler(logits.repeat(n, 1), _rows(n, 0.7), generators=generators)
    freq = torch.bincount(out[1:], minlength=5).float() / (n - 1)
    expected = torch.softmax(logits / 0.7, dim=-1)
    torch.testing.assert_close(freq, expected, atol=0.02, rtol=0)


def test_top_k_distribution_renormalised() -> None:
    torch.manual_seed(1)
    logits = torch.tensor([1.0, 0.5, 0.0, 3.0])
    n = 20000
    out = sampler(logits.repeat(n, 1), _rows(n, 1.0), torch.full((n,), 2), None)
    freq = torch.bincount(out, minlength=4).float() / n
    expected = torch.zeros(4)
    expected[[3, 0]] = torch.softmax(torch.tensor([3.0, 1.0]), dim=-1)
    torch.testing.assert_close(freq, expected, atol=0.02, rtol=0)


def test_generator_count_must_match_batch() -> None:
    with pytest.raises(ValueError, match="generators"):
        sampler(torch.randn(3, 10), _rows(3, 1.0), generators=[None])
