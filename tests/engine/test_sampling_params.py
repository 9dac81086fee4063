"""SamplingParams validation: every bad value names its field and what is allowed."""

import numpy as np
import pytest

from myvllm.sampling_parameters import MAX_TEMPERATURE, SamplingParams


def test_defaults() -> None:
    p = SamplingParams()
    assert (p.temperature, p.top_k, p.top_p, p.max_tokens, p.ignore_eos, p.seed) == (
        1.0, -1, 1.0, 64, False, None)


def test_valid_edges() -> None:
    p = SamplingParams(temperature=0, top_k=1, top_p=1e-6, max_tokens=1, ignore_eos=True, seed=0)
    assert p.temperature == 0 and p.top_k == 1 and p.seed == 0


@pytest.mark.parametrize(
    "field, value, allowed",
    [
        ("temperature", -0.1, ">= 0"),
        ("temperature", float("nan"), ">= 0"),
        ("temperature", float("inf"), ">= 0"),
        ("temperature", "1", ">= 0"),
        ("top_k", 0, "-1"),
        ("top_k", -2, "-1"),
        ("top_k", 1.5, "-1"),
        ("top_p", 0.0, r"\(0, 1\]"),
        ("top_p", 1.01, r"\(0, 1\]"),
        ("max_tokens", 0, ">= 1"),
        ("max_tokens", 3.0, ">= 1"),
        ("ignore_eos", 1, "True or False"),
        ("top_k", 2**63, r"\[1, 2\*\*63 - 1\]"),  # top_k is an int64 on the device
        ("seed", -1, r"None or an int in \[0, 2\*\*64 - 1\]"),
        ("seed", 1.0, r"None or an int in \[0, 2\*\*64 - 1\]"),
        ("seed", 2**64, r"None or an int in \[0, 2\*\*64 - 1\]"),  # torch seeds are uint64
    ],
)
def test_bad_values_raise_naming_field(field: str, value: object, allowed: str) -> None:
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}=.*: allowed: .*{allowed}"):
        SamplingParams(**{field: value})


def test_largest_seed_and_top_k_are_accepted() -> None:
    p = SamplingParams(seed=2**64 - 1, top_k=2**63 - 1)
    assert p.seed == 2**64 - 1 and p.top_k == 2**63 - 1


@pytest.mark.parametrize("temperature", [1e-45, 1e-30, 0.009])
def test_tiny_temperature_is_raised_to_the_minimum(temperature: float) -> None:
    # logits / 1e-45 overflow float32 and the softmax turns NaN: raised, not left to sample
    # token 0.
    assert SamplingParams(temperature=temperature).temperature == 0.01
    assert SamplingParams(temperature=0.0).temperature == 0.0
    assert SamplingParams(temperature=0.01).temperature == 0.01


@pytest.mark.parametrize("temperature", [1e39, 1e308])
def test_huge_temperature_is_lowered_to_the_largest_float32(temperature: float) -> None:
    # As float32 on the device it would be inf; the largest float32 samples as uniformly.
    p = SamplingParams(temperature=temperature)
    assert p.temperature == MAX_TEMPERATURE and np.isfinite(np.float32(p.temperature))
    assert SamplingParams(temperature=1e38).temperature == 1e38


def test_sampling_control_defaults_are_vllms() -> None:
    p = SamplingParams()
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.min_p,
            p.logit_bias, p.min_tokens, p.stop_token_ids) == (0.0, 0.0, 1.0, 0.0, None, 0, None)


def test_sampling_controls_are_copied() -> None:
    bias, stops = {3: 1}, [5]
    p = SamplingParams(logit_bias=bias, stop_token_ids=stops, min_tokens=64,
                       presence_penalty=-2, frequency_penalty=2, repetition_penalty=0.01,
                       min_p=1.0)
    bias[4] = 2.0
    stops.append(6)
    assert p.logit_bias == {3: 1.0} and isinstance(p.logit_bias[3], float)
    assert p.stop_token_ids == [5]


@pytest.mark.parametrize(
    "field, value, allowed",
    [
        ("presence_penalty", 2.5, r"\[-2, 2\]"),
        ("presence_penalty", float("nan"), r"\[-2, 2\]"),
        ("frequency_penalty", -2.01, r"\[-2, 2\]"),
        ("frequency_penalty", True, r"\[-2, 2\]"),
        ("repetition_penalty", 0.0, "> 0"),
        ("repetition_penalty", float("inf"), "> 0"),
        ("min_p", -0.1, r"\[0, 1\]"),
        ("min_p", 1.5, r"\[0, 1\]"),
        ("min_tokens", -1, r"\[0, max_tokens = 64\]"),
        ("min_tokens", 65, r"\[0, max_tokens = 64\]"),
        ("min_tokens", 1.0, r"\[0, max_tokens = 64\]"),
        ("logit_bias", [1, 2], "None or a dict"),
        ("logit_bias", {"3": 1.0}, "token ids"),
        ("logit_bias", {-1: 1.0}, "token ids"),
        ("logit_bias", {3: float("inf")}, "finite numbers"),
        ("logit_bias", {3: "1"}, "finite numbers"),
        ("stop_token_ids", 3, "None or a list of token ids"),
        ("stop_token_ids", [3, -1], "None or a list of token ids"),
        ("stop_token_ids", [3.0], "None or a list of token ids"),
    ],
)
def test_bad_sampling_controls_raise_naming_field(field: str, value: object,
                                                  allowed: str) -> None:
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}\b.*allowed: .*{allowed}"):
        SamplingParams(**{field: value})
