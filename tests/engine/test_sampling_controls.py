"""Sampling controls on a batch's logits, against transformers' logits processors.

Each test builds real Sequences with SamplingParams, lets sample/sampling_controls.py turn
them into the tensors of layers/logits_processors.py, and compares process_logits (and the
Sampler's min-p) with transformers applied row by row to the same logits: the repetition
penalty (RepetitionPenaltyLogitsProcessor, over prompt + completion), min-p
(MinPLogitsWarper), min_tokens (MinNewTokensLengthLogitsProcessor), logit_bias
(SequenceBiasLogitsProcessor), and presence / frequency penalties by OpenAI's formula.
"""

from __future__ import annotations

import pytest
import torch
from transformers import (MinNewTokensLengthLogitsProcessor, MinPLogitsWarper,
                          RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor)

from myvllm import SamplingParams
from myvllm.sample.sampling_controls import needs_full_sampler
from myvllm.sample.sampling_controls import prepare_logits_processing, uses_sampling_controls
from myvllm.engine.sequence import Sequence
from myvllm.layers.logits_processors import apply_min_p, process_logits
from myvllm.layers.sampler import Sampler
from myvllm.worker.pending_tokens import add_pending_token

VOCAB = 50
EOS = frozenset({0})


def to_device(values: list[int] | list[float], dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype)


def sequence(prompt: list[int], completion: list[int], **params: object) -> Sequence:
    seq = Sequence(prompt, block_size=4, sampling_params=SamplingParams(**params))
    for token in completion:
        seq.append_token(token)
    return seq


def presence_frequency(ids: list[int], scores: torch.Tensor, presence: float,
                       frequency: float) -> torch.Tensor:
    """OpenAI's definition: logit -= frequency * count + presence * (count > 0)."""
    counts = torch.bincount(torch.tensor(ids, dtype=torch.int64), minlength=VOCAB).float()
    return scores - frequency * counts - presence * (counts > 0).float()


def processed(seqs: list[Sequence], logits: torch.Tensor,
              pool: torch.Tensor | None = None) -> torch.Tensor:
    pool = torch.zeros(8, dtype=torch.int64) if pool is None else pool
    processing = prepare_logits_processing(seqs, to_device, pool, EOS)
    assert processing is not None
    return process_logits(logits, processing)


@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_repetition_penalty_matches_transformers(penalty: float) -> None:
    torch.manual_seed(0)
    prompts = [[3, 4, 5, 4], [7, 8], [9]]
    completions = [[5, 11, 11], [], [12, 3, 9]]
    logits = torch.randn(3, VOCAB) * 3
    seqs = [sequence(p, c, repetition_penalty=penalty) for p, c in zip(prompts, completions)]
    ours = processed(seqs, logits)
    for row, (p, c) in enumerate(zip(prompts, completions)):
        ref = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([p + c]), logits[row:row + 1])
        torch.testing.assert_close(ours[row], ref[0])


def test_presence_and_frequency_penalties_follow_openais_formula() -> None:
    torch.manual_seed(1)
    logits = torch.randn(3, VOCAB)
    rows = [([1, 2, 3], [4, 4, 4, 5], 0.5, 1.5), ([4, 4], [6], -2.0, 2.0),
            ([7], [8, 8], 0.0, -0.7)]
    seqs = [sequence(p, c, presence_penalty=pp, frequency_penalty=fp) for p, c, pp, fp in rows]
    ours = processed(seqs, logits)
    for row, (_, completion, pp, fp) in enumerate(rows):
        # Only the completion counts: the prompt's 4s in row 1 are not penalised.
        torch.testing.assert_close(ours[row], presence_frequency(completion, logits[row], pp, fp))


def test_logit_bias_matches_sequence_bias_processor() -> None:
    torch.manual_seed(2)
    logits = torch.randn(2, VOCAB)
    biases = [{3: 5.0, 17: -100.0, 49: 0.25}, {}]
    seqs = [sequence([1, 2], [], logit_bias=b or None) for b in biases]
    ours = processed(seqs, logits)
    ref = SequenceBiasLogitsProcessor([[[t], b] for t, b in biases[0].items()])(
        torch.tensor([[1, 2]]), logits[:1].clone())
    torch.testing.assert_close(ours[0], ref[0])
    assert torch.equal(ours[1], logits[1])  # a row without a bias is untouched


@pytest.mark.parametrize("num_generated", [0, 2, 3, 5])
def test_min_tokens_matches_min_new_tokens_processor(num_generated: int) -> None:
    torch.manual_seed(3)
    prompt = [5, 6, 7]
    logits = torch.randn(1, VOCAB)
    seq = sequence(prompt, [9] * num_generated, min_tokens=3, max_tokens=10,
                   stop_token_ids=[13], logit_bias={20: 0.5})  # the bias keeps the row active
    ours = processed([seq], logits)
    ids = torch.tensor([prompt + [9] * num_generated])
    ref = SequenceBiasLogitsProcessor([[[20], 0.5]])(ids, logits.clone())
    ref = MinNewTokensLengthLogitsProcessor(len(prompt), 3, [0, 13])(ids, ref)
    torch.testing.assert_close(ours[0], ref[0])
    assert (ours[0, 0] == float("-inf")) == (num_generated < 3)


def test_min_tokens_counts_a_pending_token() -> None:
    """Async scheduling: the token of the step in flight counts (num_tokens), though the host
    has not read it; with it the row has its min_tokens and is no longer masked."""
    seq = sequence([5, 6], [9], min_tokens=2)
    assert uses_sampling_controls(seq)
    add_pending_token(seq)
    assert not uses_sampling_controls(seq)
    assert prepare_logits_processing([seq], to_device, torch.zeros(4, dtype=torch.int64),
                                     EOS) is None


def test_penalties_read_a_pending_token_from_the_pool() -> None:
    """The completion's newest token is still on the device (async scheduling): it is read
    from its row of the sampled-token pool and penalised like the known ones."""
    torch.manual_seed(4)
    logits = torch.randn(2, VOCAB)
    seqs = [sequence([1, 2], [3], frequency_penalty=1.0, repetition_penalty=1.5),
            sequence([4], [5, 6], presence_penalty=0.5)]
    pool = torch.tensor([0, 0, 7, 0, 0, 3], dtype=torch.int64)
    for seq, row in zip(seqs, [5, 2]):
        add_pending_token(seq)
        seq.sampled_row = row
    ours = processed(seqs, logits, pool)
    ref0 = RepetitionPenaltyLogitsProcessor(1.5)(torch.tensor([[1, 2, 3, 3]]), logits[:1])
    torch.testing.assert_close(ours[0], presence_frequency([3, 3], ref0[0], 0.0, 1.0))
    torch.testing.assert_close(ours[1], presence_frequency([5, 6, 7], logits[1], 0.5, 0.0))


def test_all_controls_in_vllms_order() -> None:
    """logit_bias, then min_tokens, then repetition, frequency and presence: the bias is
    penalised with the logit it is added to."""
    torch.manual_seed(5)
    logits = torch.randn(1, VOCAB) * 2
    prompt, completion = [1, 2, 3], [3, 4]
    seq = sequence(prompt, completion, logit_bias={3: 2.0, 8: -1.0}, min_tokens=4,
                   repetition_penalty=1.7, frequency_penalty=0.3, presence_penalty=0.2)
    ids = torch.tensor([prompt + completion])
    ref = SequenceBiasLogitsProcessor([[[3], 2.0], [[8], -1.0]])(ids, logits.clone())
    ref = MinNewTokensLengthLogitsProcessor(len(prompt), 4, [0])(ids, ref)
    ref = RepetitionPenaltyLogitsProcessor(1.7)(ids, ref)
    ref = presence_frequency(completion, ref[0], 0.2, 0.3)
    torch.testing.assert_close(processed([seq], logits)[0], ref)


@pytest.mark.parametrize("min_p", [0.0, 0.05, 0.3, 1.0])
def test_min_p_matches_transformers(min_p: float) -> None:
    torch.manual_seed(6)
    logits = torch.randn(4, VOCAB) * 2
    ours = apply_min_p(logits, torch.full((4,), min_p))
    ref = MinPLogitsWarper(min_p)(torch.zeros(4, 1, dtype=torch.int64), logits.clone())
    assert torch.equal(ours.isinf(), ref.isinf())
    torch.testing.assert_close(ours[~ours.isinf()], ref[~ref.isinf()])


def test_sampler_min_p_samples_only_kept_tokens() -> None:
    torch.manual_seed(7)
    logits = torch.randn(3, VOCAB) * 3
    temperatures = torch.tensor([0.8, 0.0, 1.5])
    min_ps = torch.tensor([0.1, 0.9, 0.0])
    kept = ~apply_min_p(logits[:1] / 0.8, min_ps[:1]).isinf()[0]  # row 0 after temperature
    assert 1 < int(kept.sum()) < VOCAB
    seen = set()
    for _ in range(200):
        tokens = Sampler()(logits, temperatures, min_ps=min_ps, all_greedy=False)
        assert kept[tokens[0]]
        assert tokens[1] == logits[1].argmax()  # greedy rows: argmax whatever min_p is
        seen.add(int(tokens[2]))
    assert len(seen) > 5  # min_p 0 leaves the distribution alone


def test_no_controls_no_processing_and_the_graph_path() -> None:
    """Rows that ask for nothing build nothing and keep a decode graph's in-graph sampling;
    one that asks takes the whole batch to the full sampler."""
    plain = [sequence([1, 2], [3]), sequence([4], [], temperature=0.5, stop_token_ids=[7])]
    assert prepare_logits_processing(plain, to_device, torch.zeros(2, dtype=torch.int64),
                                     EOS) is None
    assert not needs_full_sampler(plain)
    for params in [dict(presence_penalty=0.1), dict(frequency_penalty=-0.1),
                   dict(repetition_penalty=1.1), dict(min_p=0.1), dict(logit_bias={1: 1.0}),
                   dict(min_tokens=5)]:
        assert needs_full_sampler(plain + [sequence([1], [], **params)]), params
