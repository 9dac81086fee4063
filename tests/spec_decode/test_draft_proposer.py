"""The draft-model proposer end to end on the CPU (speculative_method="draft").

Greedy: the tokens equal plain decoding's, token for token, whatever the draft: the target
itself as its own draft (every proposal accepted: the counters say so), a different random
model of the same vocabulary (nearly every proposal rejected), over prefix caching, chunked
prefill and preemption, with every block free at the end. Sampling: the emitted tokens'
distribution is the target's (a chi-square test against HF transformers' exact marginals
on a tiny vocabulary), and a draft equal to the target is accepted at every position (q = p,
so min(1, p/q) = 1: a q that differs from p would show as rejections).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch
from helpers_models import build_tiny_checkpoint, random_prompts, tiny_checkpoint
from test_spec_decode_engine import check_all_blocks_free, generate, stats

from myvllm import LLM, Config, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
COMMON = dict(block_size=4, max_model_length=128, num_kvcache_blocks=160, dtype="float32")


def prompts() -> list[list[int]]:
    return [[5, 6, 7, 8, 9, 10, 11] * 5, *random_prompts([23, 9, 40, 3], seed=7)]


@pytest.fixture(scope="module")
def target() -> str:
    return str(tiny_checkpoint("qwen3"))


@pytest.fixture(scope="module")
def other_draft() -> str:
    """A random Llama with the target's vocabulary but nothing else in common."""
    return str(build_tiny_checkpoint("llama", Path(tempfile.mkdtemp()) / "draft", seed=5))


@pytest.fixture(scope="module")
def reference(target: str) -> list[list[int]]:
    return generate(LLM(target, **COMMON), prompts(), GREEDY)


SETTINGS = [
    dict(),
    dict(num_speculative_tokens=1),
    dict(num_speculative_tokens=5, enable_prefix_caching=False),
    dict(max_num_batched_tokens=8),  # prompts in chunks beside verification rows
    dict(num_kvcache_blocks=28, max_num_sequences=5),  # preemption
]
IDS = ["default", "k1", "k5-no-cache", "chunked", "preemption"]


def count_preemptions(llm: LLM) -> list[int]:
    """A list that grows by one at each preemption of llm's scheduler."""
    scheduler, seen = llm.engine_core.scheduler, []
    preempt = scheduler.preempt

    def counting(seq: object) -> None:
        seen.append(1)
        preempt(seq)  # type: ignore[arg-type]
    scheduler.preempt = counting  # type: ignore[method-assign]
    return seen


@pytest.mark.parametrize("settings", SETTINGS, ids=IDS)
def test_the_target_as_its_own_draft_is_always_accepted(
        target: str, reference: list[list[int]], settings: dict[str, object]) -> None:
    llm = LLM(target, **{**COMMON, **settings}, speculative_method="draft",
              speculative_model=target)
    preemptions = count_preemptions(llm)
    assert generate(llm, prompts(), GREEDY) == reference
    # The draft recomputes a preempted sequence from position 0, or proposals would fail.
    assert bool(preemptions) == ("num_kvcache_blocks" in settings)
    counts = stats(llm)
    assert counts.num_drafts > 0
    assert counts.num_accepted_tokens == counts.num_draft_tokens
    check_all_blocks_free(llm)


@pytest.mark.parametrize("settings", SETTINGS, ids=IDS)
def test_a_different_draft_is_rejected_and_changes_nothing(
        target: str, other_draft: str, reference: list[list[int]],
        settings: dict[str, object]) -> None:
    llm = LLM(target, **{**COMMON, **settings}, speculative_method="draft",
              speculative_model=other_draft)
    preemptions = count_preemptions(llm)
    assert generate(llm, prompts(), GREEDY) == reference
    assert bool(preemptions) == ("num_kvcache_blocks" in settings)
    counts = stats(llm)
    assert counts.num_drafts > 0
    assert counts.num_accepted_tokens < counts.num_draft_tokens / 2
    check_all_blocks_free(llm)


def test_sampled_proposals_of_the_target_itself_are_always_accepted(target: str) -> None:
    """q = p exactly when the draft is the target with the request's own settings."""
    llm = LLM(target, **COMMON, speculative_method="draft", speculative_model=target)
    params = SamplingParams(temperature=0.9, top_k=40, top_p=0.9, max_tokens=16,
                            ignore_eos=True)
    generate(llm, prompts(), params)
    counts = stats(llm)
    assert counts.num_draft_tokens > 0
    # fp32 rounding may flip a test of u < p/q at p/q = 1 - 1e-7, once in ten million.
    assert counts.num_accepted_tokens == counts.num_draft_tokens


def test_seeded_sampling_repeats(target: str, other_draft: str) -> None:
    llm = LLM(target, **COMMON, speculative_method="draft", speculative_model=other_draft)
    params = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, seed=3)
    first = generate(llm, prompts(), params)
    assert generate(llm, prompts(), params) == first
    check_all_blocks_free(llm)


V = 8  # a tiny vocabulary: thousands of samples cover it
DRAWS = 3000
CHI2_999_DF7 = 24.32  # chi-square's 0.999 quantile, 7 degrees of freedom


def exact_marginals(path: str, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's distributions of the 2nd and 3rd sampled tokens at temperature 1
    (summed over the tokens before them), from HF transformers."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        def next_probs(contexts: torch.Tensor) -> torch.Tensor:
            return torch.softmax(model(contexts).logits[:, -1].float(), dim=-1)

        base = torch.tensor([prompt])
        p1 = next_probs(base)[0]  # [V]
        ctx1 = torch.cat([base.expand(V, -1), torch.arange(V).unsqueeze(1)], dim=1)
        p2_given = next_probs(ctx1)  # [V, V]: row t1
        ctx2 = torch.cat([ctx1.repeat_interleave(V, 0), torch.arange(V).repeat(V).unsqueeze(1)],
                         dim=1)
        p3_given = next_probs(ctx2).view(V, V, V)  # [t1, t2, V]
    joint12 = p1.unsqueeze(1) * p2_given  # [t1, t2]
    return joint12.sum(0), (joint12.unsqueeze(-1) * p3_given).sum((0, 1))


def chi_square(tokens: list[int], p: torch.Tensor) -> float:
    counts = torch.bincount(torch.tensor(tokens), minlength=V).double()
    expected = p.double() * len(tokens)
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.slow
def test_sampled_tokens_keep_the_target_distribution() -> None:
    """A random draft (its own q, far from p) under min(1, p/q) and the residual
    max(0, p - q): the 2nd and 3rd tokens (the first ones verification emits) are
    distributed as the target alone samples them."""
    root = Path(tempfile.mkdtemp())
    target = str(build_tiny_checkpoint("qwen3", root / "target", seed=1, vocab_size=V))
    draft = str(build_tiny_checkpoint("llama", root / "draft", seed=2, vocab_size=V))
    prompt = [1, 2, 3, 4, 5]
    p2, p3 = exact_marginals(target, prompt)
    llm = LLM(target, **{**COMMON, "num_kvcache_blocks": 4 * DRAWS // 2},
              max_num_sequences=256, speculative_method="draft", speculative_model=draft,
              num_speculative_tokens=2)
    params = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True)
    outs = generate(llm, [prompt] * DRAWS, params)
    counts = stats(llm)
    assert 0 < counts.num_accepted_tokens < counts.num_draft_tokens  # both branches ran
    assert chi_square([out[1] for out in outs], p2) < CHI2_999_DF7
    assert chi_square([out[2] for out in outs], p3) < CHI2_999_DF7


def test_rows_asking_logprobs_decode_one_token_at_a_time(
        target: str, other_draft: str, reference: list[list[int]]) -> None:
    """Per-token logprobs come from the one-token path under a draft model too: such a row
    gets no proposals (its tokens and one logprobs entry per token as without speculation);
    the others still do."""
    llm = LLM(target, **COMMON, speculative_method="draft", speculative_model=other_draft)
    with_logprobs = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    outs = llm.generate(prompts()[:1], with_logprobs, use_tqdm=False)
    assert stats(llm).num_drafts == 0, "the logprobs request was speculated"
    assert [out["token_ids"] for out in outs] == reference[:1]
    assert len(outs[0]["logprobs"]) == len(reference[0])
    params = [with_logprobs] + [GREEDY] * (len(prompts()) - 1)
    outs = llm.generate(prompts(), params, use_tqdm=False)
    assert [out["token_ids"] for out in outs] == reference
    assert stats(llm).num_drafts > 0  # the other rows speculated


@pytest.mark.slow
def test_bundled_model_as_its_own_draft_is_unchanged_and_accepted() -> None:
    """Plain decoding's tokens come from the same engine: a request that asks for logprobs
    decodes one token at a time with no proposals (the quick test above checks that path),
    so the bundled model is loaded twice (target and draft), not three times (each load is
    most of this test's time). Prefix caching is off, so the speculated request prefills its
    prompt as the plain one did, not from the plain one's blocks."""
    from myvllm.utils.model_path import bundled_model_path

    prompt = "The capital of France is"
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    one_at_a_time = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=1)
    spec = LLM(None, dtype="float32", max_model_length=256, speculative_method="draft",
               speculative_model=bundled_model_path(), num_speculative_tokens=3,
               enable_prefix_caching=False)
    expected = spec.generate([prompt], one_at_a_time, use_tqdm=False)[0]["token_ids"]
    assert stats(spec).num_drafts == 0, "the logprobs request was speculated"
    assert spec.generate([prompt], params, use_tqdm=False)[0]["token_ids"] == expected
    counts = stats(spec)
    assert counts.num_drafts > 0 and counts.acceptance_rate > 0.9


def test_a_draft_of_another_vocabulary_is_refused(target: str) -> None:
    other = str(build_tiny_checkpoint("qwen3", Path(tempfile.mkdtemp()) / "v8", vocab_size=8))
    with pytest.raises(ValueError, match="vocabulary of 8 tokens, the target model one of 256"):
        LLM(target, **COMMON, speculative_method="draft", speculative_model=other)


@pytest.mark.parametrize("settings, message", [
    (dict(speculative_method="draft"), "needs Config.speculative_model"),
    (dict(speculative_method="draft", speculative_model="d", tensor_parallel_size=2),
     "does not combine with Config.tensor_parallel_size=2; allowed: "),
    (dict(speculative_method="ngram", speculative_model="d"), "only read with"),
])
def test_bad_settings_are_refused(settings: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Config(**settings)  # type: ignore[arg-type]
