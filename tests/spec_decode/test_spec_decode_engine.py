"""Speculative decoding end to end on the CPU: the engine with n-gram proposals gives the
tokens it gives without them (greedy, token for token), over prefix caching, chunked prefill,
prefill-first steps, preemption, max_tokens and eos; bad settings are refused.

The tiny random models soon repeat themselves, so prompt lookup's proposals are nearly all
accepted there. To exercise rejection on the real model as well, one test swaps the
proposer for an oracle that knows the greedy continuation and corrupts some of it: rows
then accept all, some or none of their proposals.
"""

from __future__ import annotations

import random

import pytest
from helpers_models import random_prompts, tiny_checkpoint

from helpers_blocks import used_block_ids
from myvllm import LLM, SamplingParams
from myvllm.spec_decode.stats import SpecDecodeStats

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
REPETITIVE = [5, 6, 7, 8, 9, 10, 11] * 5
COMMON = dict(block_size=4, max_model_length=128, num_kvcache_blocks=160)


def prompts() -> list[list[int]]:
    return [REPETITIVE, *random_prompts([23, 9, 40], seed=7), [1, 2, 3] * 4]


def generate(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    return [out["token_ids"] for out in llm.generate(prompts, params, use_tqdm=False)]


def stats(llm: LLM) -> SpecDecodeStats:
    speculator = llm.engine_core.scheduler.speculator
    assert speculator is not None
    return speculator.stats


def check_all_blocks_free(llm: LLM) -> None:
    blocks = llm.engine_core.scheduler.block_manager
    assert not used_block_ids(blocks) and len(blocks.free_block_ids) == len(blocks.blocks)


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    return generate(LLM(str(tiny_checkpoint("qwen3")), **COMMON), prompts(), GREEDY)


@pytest.mark.parametrize("settings", [
    dict(),
    dict(num_speculative_tokens=1, prompt_lookup_min=1, prompt_lookup_max=1),
    dict(num_speculative_tokens=5, enable_prefix_caching=False),
    dict(max_num_batched_tokens=8),  # prompts in chunks beside verification rows
    dict(enable_chunked_prefill=False, max_num_batched_tokens=64),  # prefill-first
    dict(num_kvcache_blocks=28, max_num_sequences=5),  # preemption
], ids=["default", "k1", "k5-no-cache", "chunked", "prefill-first", "preemption"])
def test_greedy_tokens_equal_plain_decoding(reference: list[list[int]],
                                            settings: dict[str, int]) -> None:
    llm = LLM(str(tiny_checkpoint("qwen3")), **{**COMMON, **settings},
              speculative_method="ngram")
    assert generate(llm, prompts(), GREEDY) == reference
    assert stats(llm).num_accepted_tokens > 0
    check_all_blocks_free(llm)


@pytest.mark.parametrize("settings, through_prefill", [
    (dict(), False),  # only decode and verification rows: all of them as decode rows
    (dict(max_num_batched_tokens=8), True),  # prompt chunks beside verification rows
], ids=["decode-rows", "beside-chunks"])
def test_verification_runs_as_decode_rows_without_a_prompt_chunk_beside_it(
        reference: list[list[int]], settings: dict[str, int], through_prefill: bool,
        monkeypatch: pytest.MonkeyPatch) -> None:
    import myvllm.spec_decode.verification as verification

    llm = LLM(str(tiny_checkpoint("qwen3")), **{**COMMON, **settings},
              speculative_method="ngram")
    paths: list[str] = []
    as_decode = verification.verification_decode_step
    prefill = verification.forward_prefill_with_features

    def recording_decode_step(*args: object) -> object:
        paths.append("decode")
        return as_decode(*args)  # type: ignore[arg-type]

    def recording_prefill(runner: object, seqs: object, features: object,
                          verifying: object = None) -> object:
        if verifying is not None:
            paths.append("prefill")
        return prefill(runner, seqs, features, verifying)  # type: ignore[arg-type]

    monkeypatch.setattr(verification, "verification_decode_step", recording_decode_step)
    monkeypatch.setattr(verification, "forward_prefill_with_features", recording_prefill)
    assert generate(llm, prompts(), GREEDY) == reference
    assert "decode" in paths
    assert ("prefill" in paths) == through_prefill


class CorruptingOracle:
    """Proposes the known greedy continuation, each token replaced by a wrong one with
    probability 1/3: rows accept all, a prefix, or none of their proposals."""

    def __init__(self, sequences: list[list[int]], vocab: int) -> None:
        self.sequences = sequences
        self.vocab = vocab
        self.rng = random.Random(0)

    def propose(self, token_ids: list[int], max_tokens: int) -> list[int]:
        for full in self.sequences:
            if full[:len(token_ids)] == token_ids:
                right = full[len(token_ids):len(token_ids) + max_tokens]
                return [t if self.rng.random() > 1 / 3 else (t + 1) % self.vocab
                        for t in right]
        return []


@pytest.mark.parametrize("kind", ["qwen3", "llama3"])
def test_rejected_proposals_leave_the_tokens_unchanged(kind: str) -> None:
    path = str(tiny_checkpoint(kind))
    batch = random_prompts([17, 30, 5, 44], seed=11)
    reference = generate(LLM(path, **COMMON), batch, GREEDY)
    llm = LLM(path, **COMMON, speculative_method="ngram", num_speculative_tokens=4)
    speculator = llm.engine_core.scheduler.speculator
    assert speculator is not None
    speculator.proposer = CorruptingOracle(  # type: ignore[assignment]
        [p + r for p, r in zip(batch, reference, strict=True)], llm.vocab_size)
    assert generate(llm, batch, GREEDY) == reference
    counts = stats(llm)
    # Some rows accepted all, some only a part: both paths of the rollback ran.
    assert 0 < counts.num_accepted_tokens < counts.num_draft_tokens
    assert counts.accepted_per_position[0] > counts.accepted_per_position[-1] > 0
    check_all_blocks_free(llm)


def test_max_tokens_and_eos_cut_the_accepted_tokens(reference: list[list[int]]) -> None:
    """Proposals are cut to what max_tokens leaves, and tokens after an eos are dropped,
    as if the row had decoded them one by one."""
    path = str(tiny_checkpoint("qwen3"))
    llm = LLM(path, **COMMON, speculative_method="ngram", num_speculative_tokens=5)
    for max_tokens in (1, 2, 7):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        assert generate(llm, prompts(), params) == [r[:max_tokens] for r in reference]
    # eos: a token the completions hold, with eos honoured this time
    stopping = SamplingParams(temperature=0.0, max_tokens=24)
    eos = reference[1][4]
    plain = generate(LLM(path, **COMMON, eos=eos), prompts(), stopping)
    spec = LLM(path, **COMMON, eos=eos, speculative_method="ngram", num_speculative_tokens=5)
    assert generate(spec, prompts(), stopping) == plain
    assert any(len(tokens) < 24 and tokens[-1] == eos for tokens in plain)
    check_all_blocks_free(spec)


def test_seeded_sampling_repeats_and_rejects() -> None:
    """Random rows: a seed gives the same tokens again; proposals are rejected sometimes."""
    path = str(tiny_checkpoint("qwen3"))
    params = SamplingParams(temperature=1.0, top_k=20, max_tokens=16, ignore_eos=True, seed=3)
    llm = LLM(path, **COMMON, speculative_method="ngram", prompt_lookup_min=1)
    batch = prompts()[:3]
    first = generate(llm, batch, params)
    assert generate(llm, batch, params) == first
    counts = stats(llm)
    assert 0 < counts.num_accepted_tokens < counts.num_draft_tokens
    check_all_blocks_free(llm)


def test_stepwise_outputs_carry_several_tokens() -> None:
    """add_request/step (the streaming path): a verification step hands a request all the
    tokens it emitted at once."""
    llm = LLM(str(tiny_checkpoint("qwen3")), **COMMON, speculative_method="ngram")
    request_id = llm.add_request(REPETITIVE, GREEDY)
    sizes = []
    while not llm.is_finished():
        for out in llm.engine_core.step()[0]:
            assert out.request_id == request_id
            sizes.append(len(out.new_token_ids))
    assert sum(sizes) == GREEDY.max_tokens and max(sizes) > 1


@pytest.mark.parametrize("settings, message", [
    (dict(speculative_method="eagle"),
     "speculative_method='eagle': allowed: None, 'ngram', 'draft'"),
    (dict(speculative_method="draft"), "needs Config.speculative_model"),
    (dict(speculative_method="ngram", num_speculative_tokens=0), "num_speculative_tokens"),
    (dict(speculative_method="ngram", prompt_lookup_min=3, prompt_lookup_max=2),
     "prompt_lookup_min=3 is more than Config.prompt_lookup_max=2; allowed: "),
    (dict(speculative_model="x.gguf"), "speculative_model"),
])
def test_bad_settings_are_refused(settings: dict[str, object], message: str) -> None:
    from myvllm import Config

    with pytest.raises(ValueError, match=message):
        Config(**settings)  # type: ignore[arg-type]


@pytest.mark.slow
def test_bundled_model_copying_a_text_is_unchanged_and_mostly_accepted() -> None:
    """The bundled SmolLM2 (real weights, fp32) asked to repeat a passage: the greedy tokens
    equal plain decoding's, and prompt lookup's proposals are mostly accepted.

    Plain decoding's tokens come from the same engine: a request that asks for logprobs
    decodes one token at a time with no proposals (a quick test below checks that path against
    an engine without speculation), so the bundled model is loaded once, not twice (each load
    is most of this test's time). Prefix caching is off, so the speculated request prefills its
    prompt as the plain one did, not from the plain one's blocks."""
    prompt = ("Repeat the following text exactly.\n\nText:\nA block table maps each "
              "sequence's logical blocks to physical ones, so memory is allocated on demand "
              "and shared between sequences with a common prefix.\n\nRepeated text:\n")
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    one_at_a_time = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1)
    spec = LLM(None, dtype="float32", max_model_length=512, speculative_method="ngram",
               num_speculative_tokens=4, enable_prefix_caching=False)
    expected = spec.generate([prompt], one_at_a_time, use_tqdm=False)[0]["token_ids"]
    assert stats(spec).num_drafts == 0, "the logprobs request was speculated"
    assert spec.generate([prompt], params, use_tqdm=False)[0]["token_ids"] == expected
    assert stats(spec).acceptance_rate > 0.5


@pytest.mark.slow
def test_tensor_parallel_verification_gives_the_tokens_of_one_rank(
        reference: list[list[int]]) -> None:
    """Two ranks (gloo on the CPU): the proposals travel with the pickled sequences and the
    LM head over the verification rows is collective; the tokens are one rank's."""
    llm = LLM(str(tiny_checkpoint("qwen3")), **COMMON, tensor_parallel_size=2,
              speculative_method="ngram")
    try:
        assert generate(llm, prompts(), GREEDY) == reference
        assert stats(llm).num_accepted_tokens > 0
    finally:
        llm.exit()


def test_rows_asking_logprobs_decode_one_token_at_a_time(reference: list[list[int]]) -> None:
    """Per-token logprobs come from the one-token path: such a row gets no proposals (its
    tokens and one logprobs entry per token as without speculation); the others still do."""
    llm = LLM(str(tiny_checkpoint("qwen3")), **COMMON, speculative_method="ngram")
    with_logprobs = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    params = [with_logprobs] + [GREEDY] * (len(prompts()) - 1)
    outs = llm.generate(prompts(), params, use_tqdm=False)
    assert [out["token_ids"] for out in outs] == reference
    assert len(outs[0]["logprobs"]) == len(reference[0])
    assert stats(llm).num_accepted_tokens > 0  # the other rows speculated
