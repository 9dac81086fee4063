"""The greedy fast path of verification (host-side acceptance from the argmax of every
logit row) against the general path (rejection_sample with temperature 0, on the device),
and the engine taking it: a greedy step never reaches the Sampler or rejection_sample."""

from __future__ import annotations

import os

import pytest
import torch
from helpers_models import tiny_checkpoint
from hypothesis import given, settings
from hypothesis import strategies as st

from myvllm import LLM, SamplingParams
from myvllm.spec_decode import verification
from myvllm.spec_decode.rejection_sampler import PLACEHOLDER, rejection_sample
from myvllm.spec_decode.verification import accept_greedy

EXAMPLES = settings(max_examples=int(os.environ.get("MYVLLM_HYPOTHESIS_EXAMPLES", "100")),
                    deadline=None)
VOCAB = 4  # small: proposals often right, often wrong, and argmax ties happen


@EXAMPLES
@given(seed=st.integers(0, 2**31 - 1), k=st.integers(1, 5),
       num_drafts=st.lists(st.integers(0, 5), min_size=1, max_size=6))
def test_fast_path_emits_what_rejection_sampling_emits(seed: int, k: int,
                                                       num_drafts: list[int]) -> None:
    g = torch.Generator().manual_seed(seed)
    batch = len(num_drafts)
    num_drafts = [min(n, k) for n in num_drafts]
    # Rounded logits: exact ties, where both paths must pick the same (first) argmax.
    logits = torch.randint(0, 3, (batch, k + 1, VOCAB), generator=g).float()
    drafts = torch.randint(0, VOCAB, (batch, k), generator=g)
    argmax = logits.argmax(dim=-1)
    # Half the proposals copied from the argmax, so long accepted runs occur.
    drafts = torch.where(torch.rand(batch, k, generator=g) < 0.6, argmax[:, :k], drafts)
    general = rejection_sample(logits, drafts, num_drafts, torch.zeros(batch))
    for row in range(batch):
        n = num_drafts[row]
        expected = [t for t in general[row].tolist() if t != PLACEHOLDER]
        assert accept_greedy(drafts[row, :n].tolist(), argmax[row, :n + 1].tolist()) == expected


def test_accept_greedy_stops_at_the_first_mismatch() -> None:
    assert accept_greedy([4, 5, 6], [4, 5, 9, 7]) == [4, 5, 9]
    assert accept_greedy([4, 5, 6], [4, 5, 6, 7]) == [4, 5, 6, 7]  # all, and the bonus
    assert accept_greedy([4], [3, 8]) == [3]
    assert accept_greedy([], [3]) == [3]


@pytest.mark.slow
def test_greedy_steps_take_the_fast_path_and_keep_the_tokens(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy verification steps go through greedy_verify alone (rejection_sample never
    runs) and give plain decoding's tokens; a step with a sampled row takes the general
    path, and its greedy rows' tokens are the same."""
    path = str(tiny_checkpoint("qwen3"))
    common = dict(block_size=4, max_model_length=128, num_kvcache_blocks=160)
    prompts = [[5, 6, 7, 8, 9, 10, 11] * 5, [1, 2, 3] * 4]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    expected = [o["token_ids"] for o in LLM(path, **common).generate(prompts, greedy,
                                                                     use_tqdm=False)]
    calls = {"fast": 0, "general": 0}
    fast, general = verification.greedy_verify, verification.rejection_sample

    def count(name: str, fn):  # type: ignore[no-untyped-def]
        def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
            calls[name] += 1
            return fn(*args, **kwargs)
        return counted

    monkeypatch.setattr(verification, "greedy_verify", count("fast", fast))
    monkeypatch.setattr(verification, "rejection_sample", count("general", general))
    llm = LLM(path, **common, speculative_method="ngram", num_speculative_tokens=4)
    got = [o["token_ids"] for o in llm.generate(prompts, greedy, use_tqdm=False)]
    assert got == expected and calls["fast"] > 0 and calls["general"] == 0
    sampled = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, seed=1)
    got = [o["token_ids"] for o in llm.generate(prompts, [greedy, sampled], use_tqdm=False)]
    assert got[0] == expected[0] and calls["general"] > 0
