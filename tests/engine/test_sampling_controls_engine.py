"""Sampling controls end to end through the engine, on the tiny models (CPU, float32).

- penalties: greedy tokens equal transformers' generate with the same controls as logits
  processors (repetition over prompt + completion; presence / frequency by OpenAI's formula),
  with async scheduling on and off and prompts cut into chunks, beside a row that asks for
  nothing and must not change;
- logit_bias forces a token; min_tokens holds eos and stop_token_ids back until it is
  reached (also when the token of the step in flight is what reaches it); stop_token_ids end a
  request with finish_reason "stop" (even with ignore_eos), the token in token_ids, not in
  the text;
- token ids outside the vocabulary are refused before anything runs.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers_models import load_hf_reference, random_prompts, tiny_checkpoint
from transformers import LogitsProcessor, LogitsProcessorList, RepetitionPenaltyLogitsProcessor

from myvllm import LLM, SamplingParams

EOS = 0  # the tiny checkpoints' eos
FORCED = 65  # "A" in their byte-level tokenizer


class PresenceFrequencyPenalty(LogitsProcessor):
    """OpenAI's definition, over the completion (the ids after the prompt)."""

    def __init__(self, prompt_length: int, presence: float, frequency: float) -> None:
        self.prompt_length, self.presence, self.frequency = prompt_length, presence, frequency

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        completion = input_ids[:, self.prompt_length:]
        counts = torch.zeros_like(scores).scatter_add_(
            1, completion, torch.ones_like(completion, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


def hf_greedy_with(hf: Any, prompt: list[int], max_new_tokens: int,
                   processors: list[LogitsProcessor]) -> list[int]:
    hf.generation_config.eos_token_id = None  # our side: ignore_eos
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                      dtype=torch.long), max_new_tokens=max_new_tokens, do_sample=False,
                      pad_token_id=0, logits_processor=LogitsProcessorList(processors))
    return out[0, len(prompt):].tolist()


def run_to_the_end(llm: LLM, prompts: list[Any], params: list[SamplingParams]
                   ) -> list[Any]:
    """add_request / step_outputs: each request's last RequestOutput (its finish_reason)."""
    ids = [llm.add_request(p, sp) for p, sp in zip(prompts, params)]
    last: dict[int, Any] = {}
    while not llm.is_finished():
        for out in llm.step_outputs()[0]:
            last[out.request_id] = out
    return [last[i] for i in ids]


@pytest.fixture(scope="module")
def hf() -> Any:
    return load_hf_reference(tiny_checkpoint("qwen3"))


@pytest.mark.slow
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_penalties_match_transformers_generate(hf: Any, async_scheduling: bool) -> None:
    # A budget of 16 tokens: the 30-token prompt is cut into chunks, decode rows beside them.
    llm = LLM(str(tiny_checkpoint("qwen3")), max_model_length=128, max_num_batched_tokens=16,
              async_scheduling=async_scheduling)
    prompts = random_prompts([30, 9, 5, 12], seed=11)
    greedy = dict(temperature=0.0, max_tokens=14, ignore_eos=True)
    # Strong enough to change each row's greedy tokens (the random model's margins are wide).
    controls = [dict(repetition_penalty=3.0), dict(presence_penalty=2.0, frequency_penalty=2.0),
                dict(repetition_penalty=1.3, frequency_penalty=1.0, presence_penalty=-1.0), {}]
    outs = llm.generate(prompts, [SamplingParams(**greedy, **c) for c in controls],
                        use_tqdm=False)
    plain = llm.generate(prompts[3:], SamplingParams(**greedy), use_tqdm=False)
    assert outs[3]["token_ids"] == plain[0]["token_ids"]
    for prompt, out, c in zip(prompts, outs, controls):
        processors: list[LogitsProcessor] = []
        if "repetition_penalty" in c:
            processors.append(RepetitionPenaltyLogitsProcessor(c["repetition_penalty"]))
        if "presence_penalty" in c or "frequency_penalty" in c:
            processors.append(PresenceFrequencyPenalty(len(prompt), c.get("presence_penalty", 0),
                                                       c.get("frequency_penalty", 0)))
        assert out["token_ids"] == hf_greedy_with(hf, prompt, 14, processors), c
    # The penalties change something here (else the test could not fail).
    unpenalised = llm.generate(prompts[:3], SamplingParams(**greedy), use_tqdm=False)
    assert all(o["token_ids"] != u["token_ids"] for o, u in zip(outs, unpenalised))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logit_bias_forces_a_token(temperature: float) -> None:
    llm = LLM(str(tiny_checkpoint("llama")), max_model_length=64)
    params = SamplingParams(temperature=temperature, max_tokens=6, ignore_eos=True,
                            logit_bias={FORCED: 100.0})
    outs = llm.generate(random_prompts([7, 3], seed=2) + ["hi"], params, use_tqdm=False)
    assert [out["token_ids"] for out in outs] == [[FORCED] * 6] * 3
    assert outs[2]["text"] == "A" * 6
    # -100 bans: no row samples it.
    banned = SamplingParams(temperature=temperature, max_tokens=6, ignore_eos=True,
                            logit_bias={t: -100.0 for t in range(1, 256)})
    assert llm.generate(["x"], banned, use_tqdm=False)[0]["token_ids"] == [0] * 6


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_min_tokens_holds_eos_and_stop_tokens_back(async_scheduling: bool) -> None:
    llm = LLM(str(tiny_checkpoint("qwen3")), max_model_length=64,
              async_scheduling=async_scheduling)
    prompts = random_prompts([5, 8, 6, 4], seed=3)
    # Biased to +100, eos / the stop token would come first; min_tokens holds them back.
    params = [SamplingParams(temperature=0.0, max_tokens=20, min_tokens=5,
                             logit_bias={EOS: 100.0}),
              SamplingParams(temperature=1.0, max_tokens=20, min_tokens=3,
                             logit_bias={FORCED: 100.0}, stop_token_ids=[FORCED]),
              SamplingParams(temperature=0.0, max_tokens=20, min_tokens=1,
                             logit_bias={EOS: 100.0}),
              SamplingParams(temperature=0.0, max_tokens=4, min_tokens=4,
                             logit_bias={EOS: 100.0})]
    outs = run_to_the_end(llm, prompts, params)
    ids = [out.token_ids for out in outs]
    assert len(ids[0]) == 6 and EOS not in ids[0][:5] and ids[0][5] == EOS
    assert len(ids[1]) == 4 and FORCED not in ids[1][:3] and ids[1][3] == FORCED
    assert len(ids[2]) == 2 and ids[2][1] == EOS
    assert len(ids[3]) == 4 and EOS not in ids[3]
    assert [out.finish_reason for out in outs] == ["stop", "stop", "stop", "length"]


def test_stop_token_ids_end_the_request_not_the_text() -> None:
    llm = LLM(str(tiny_checkpoint("qwen3")), max_model_length=64)
    forced = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True,
                            logit_bias={FORCED: 100.0, 66: 50.0})
    # The text is "A" * 10; with "A" a stop token it ends at the first, which the text leaves out.
    out = llm.generate(["ab"], forced, use_tqdm=False)[0]
    assert out["token_ids"] == [FORCED] * 10
    stopping = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, min_tokens=2,
                              logit_bias={FORCED: 100.0, 66: 50.0}, stop_token_ids=[FORCED])
    out = llm.generate(["ab"], stopping, use_tqdm=False)[0]
    assert out["token_ids"] == [66, 66, FORCED] and out["text"] == "BB"
    [last] = run_to_the_end(llm, ["ab"], [stopping])
    assert last.finish_reason == "stop" and last.token_ids == [66, 66, FORCED]


@pytest.mark.parametrize("params, field", [
    (dict(logit_bias={256: 1.0}), "logit_bias"),
    (dict(stop_token_ids=[3, 1000]), "stop_token_ids"),
])
def test_token_ids_outside_the_vocabulary_are_refused(params: dict, field: str) -> None:
    llm = LLM(str(tiny_checkpoint("qwen3")), max_model_length=64)
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}: token id=\d+: allowed: a "
                                         r"token id of the vocabulary, \[0, 256\)"):
        llm.generate(["hi"], SamplingParams(**params), use_tqdm=False)
