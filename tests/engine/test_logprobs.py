"""Logprobs and prompt logprobs through LLM.generate, against the HF model's log-softmax.

The tiny random Qwen3 on the CPU (fp32). Each test's reference: torch.log_softmax of
transformers' logits over the prompt + the completion our engine produced.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from helpers_models import load_hf_reference, random_prompts, record_preemptions, tiny_checkpoint

from myvllm import LLM, SamplingParams

ATOL = 1e-4  # fp32 on both sides; attention kernels differ in summation order


@pytest.fixture(scope="module")
def hf() -> Any:
    return load_hf_reference(tiny_checkpoint("qwen3"))


def make_llm(**kw: Any) -> Any:
    torch.set_num_threads(1)  # a shared 2-core machine: OpenMP threads wait on each other
    return LLM(str(tiny_checkpoint("qwen3")), max_model_length=256, **kw)


def reference(hf: Any, token_ids: list[int]) -> torch.Tensor:
    """[len, V] log-softmax of the logits after each token (row i predicts token i + 1)."""
    with torch.inference_mode():
        logits = hf(torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def assert_entry(entry: dict[int, float], token: int, ref_row: torch.Tensor, k: int) -> None:
    """One token's dict: its own logprob, and the k most likely tokens' (which may include
    it: then k or k + 1 entries)."""
    assert entry[token] == pytest.approx(ref_row[token].item(), abs=ATOL)
    top = ref_row.topk(k)
    for logprob, token_id in zip(top.values.tolist(), top.indices.tolist()):
        assert entry[token_id] == pytest.approx(logprob, abs=ATOL)
    assert len(entry) in (k, k + 1)


@pytest.mark.parametrize("temperature", [0.0, 1.3], ids=["greedy", "sampled"])
def test_completion_logprobs_are_the_raw_log_softmax(hf: Any, temperature: float) -> None:
    """Before temperature and top-k/top-p: the numbers describe the model, not the sampler."""
    llm = make_llm()
    prompts = random_prompts([7, 19, 3], seed=1)
    params = SamplingParams(temperature=temperature, top_k=5 if temperature else -1,
                            max_tokens=6, ignore_eos=True, logprobs=3)
    for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
        ref = reference(hf, prompt + out["token_ids"])
        assert len(out["logprobs"]) == 6 and out["prompt_logprobs"] is None
        for i, (token, entry) in enumerate(zip(out["token_ids"], out["logprobs"])):
            assert_entry(entry, token, ref[len(prompt) - 1 + i], 3)
            if temperature == 0:  # greedy: the token is the most likely one
                assert entry[token] == max(entry.values())


def test_no_logprobs_unless_asked_and_zero_means_the_token_alone() -> None:
    llm = make_llm()
    prompt = random_prompts([5])[0]
    plain, alone = llm.generate([prompt, prompt], [
        SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=0)],
        use_tqdm=False)
    assert plain["logprobs"] is None and plain["prompt_logprobs"] is None
    assert plain["token_ids"] == alone["token_ids"]
    assert [list(entry) for entry in alone["logprobs"]] == [[t] for t in alone["token_ids"]]


@pytest.mark.parametrize("chunk", [None, 16], ids=["whole", "chunked"])
def test_prompt_logprobs_match_the_reference_across_chunks(hf: Any, chunk: int | None) -> None:
    """Every prompt token's logprob but the first (None), also when the prompt is computed in
    chunks of 16 tokens over several steps, beside another request's decode rows."""
    llm = make_llm() if chunk is None else make_llm(max_num_batched_tokens=chunk)
    prompts = random_prompts([50, 9], seed=2)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=2)
    for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
        ref = reference(hf, prompt)
        logprobs = out["prompt_logprobs"]
        assert len(logprobs) == len(prompt) and logprobs[0] is None
        for i in range(1, len(prompt)):
            assert_entry(logprobs[i], prompt[i], ref[i - 1], 2)
        assert out["logprobs"] is None


def test_a_request_with_prompt_logprobs_skips_the_prefix_cache(hf: Any) -> None:
    """A cached token has no logits: such a request computes its whole prompt (vLLM's rule)
    and reports no cached tokens; its blocks still serve later requests."""
    llm = make_llm(block_size=16)
    prompt = random_prompts([40], seed=3)[0]
    greedy = dict(temperature=0, max_tokens=2, ignore_eos=True)
    first = llm.generate([prompt], SamplingParams(**greedy), use_tqdm=False)[0]
    again = llm.generate([prompt], SamplingParams(**greedy, prompt_logprobs=1),
                         use_tqdm=False)[0]
    assert again["num_cached_tokens"] == 0 and again["token_ids"] == first["token_ids"]
    ref = reference(hf, prompt)
    for i in range(1, len(prompt)):
        assert_entry(again["prompt_logprobs"][i], prompt[i], ref[i - 1], 1)
    later = llm.generate([prompt], SamplingParams(**greedy), use_tqdm=False)[0]
    assert later["num_cached_tokens"] == 32


def test_logprobs_survive_preemption(hf: Any) -> None:
    """A cache of 8 blocks of 16 tokens for 3 requests of up to 58 tokens: some are preempted
    and recomputed; each token's logprob is reported once, and right."""
    llm = make_llm(block_size=16, num_kvcache_blocks=8, max_num_sequences=3)
    preempted = record_preemptions(llm)
    prompts = random_prompts([30, 34, 26], seed=4)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1,
                            prompt_logprobs=1)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert preempted
    for prompt, out in zip(prompts, outs):
        ref = reference(hf, prompt + out["token_ids"])
        assert len(out["prompt_logprobs"]) == len(prompt)
        assert len(out["logprobs"]) == len(out["token_ids"]) == 24
        for i in range(1, len(prompt)):
            assert_entry(out["prompt_logprobs"][i], prompt[i], ref[i - 1], 1)
        for i, token in enumerate(out["token_ids"]):
            assert_entry(out["logprobs"][i], token, ref[len(prompt) - 1 + i], 1)


@pytest.mark.parametrize("bad", [-1, 21, 1.5, "3", True])
def test_bad_logprobs_are_value_errors_naming_the_field(bad: Any) -> None:
    for name in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match=rf"SamplingParams\.{name}={re.escape(repr(bad))}: "
                                             r"allowed: None \(off\)"):
            SamplingParams(**{name: bad})
