"""Property tests of speculative decoding's bookkeeping: Scheduler + BlockManager with
n-gram proposals, driven by a fake model over random workloads (no tensors).

The fake model is the one of tests/core/test_scheduler_properties.py, reduced: the "K/V" of
position p is mix(kv[p - 1], token[p]), read back through the block table, and the next
token is kv % VOCAB. A tiny vocabulary makes n-gram proposals frequent and often wrong, so
rows accept all, some or none of theirs. Greedy verification accepts a proposal exactly when
it is the fake model's token. What must hold:

  * every sequence's output equals what the fake model gives it alone (no speculation);
  * the K/V a step reads as context is the chain of the sequence's own tokens: the slots
    of rejected proposals are never read before they are written again;
  * after every step: ref counts equal the block tables holding each block, free and used
    blocks partition the pool, no running sequence holds a block past its tokens (the
    lookahead blocks of rejected proposals are released), and every block registered for
    prefix hits holds the sequence's own tokens (never a proposal);
  * at the end every block is free.

The runner builds its inputs from pickled copies, as tensor-parallel workers do (a decode
row's copy has its last token and its proposals, no token_ids).
Examples: MYVLLM_HYPOTHESIS_EXAMPLES (default 100).
"""

from __future__ import annotations

import math
import os
import pickle
import struct
import zlib
from multiprocessing.reduction import ForkingPickler

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from helpers_blocks import used_block_ids
from myvllm.config import Config
from myvllm.executor import sequence_pickling
from myvllm.engine.scheduler import Scheduler
from myvllm.engine.sequence import Sequence, SequenceStatus
from myvllm.sample.extras import proposals_of
from myvllm.sampling_parameters import SamplingParams
from myvllm.worker.pending_tokens import add_pending_token

VOCAB = 4
SEED = 12345

SETTINGS = settings(max_examples=int(os.environ.get("MYVLLM_HYPOTHESIS_EXAMPLES", "100")),
                    deadline=None, suppress_health_check=[HealthCheck.too_slow])


def mix(prev: int, token: int) -> int:
    return zlib.crc32(struct.pack("<qq", prev, token))


def run_alone(prompt: list[int], max_tokens: int, max_model_length: int) -> list[int]:
    v = SEED
    for t in prompt:
        v = mix(v, t)
    out: list[int] = []
    while True:
        t = v % VOCAB
        out.append(t)
        if len(out) >= max_tokens or len(prompt) + len(out) >= max_model_length:
            return out
        v = mix(v, t)


class FakeVerifier:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.kv: dict[int, int] = {}

    def slot(self, seq: Sequence, pos: int) -> int:
        return seq.block_table[pos // self.block_size] * self.block_size + pos % self.block_size

    def run(self, batch: list[Sequence]) -> tuple[list[Sequence], list[int], dict[int, list[int]]]:
        """One step on worker copies: (the sequences that sample, their tokens, what the
        verification rows emitted by index among those)."""
        samplers: list[Sequence] = []
        tokens: list[int] = []
        verified: dict[int, list[int]] = {}
        sequence_pickling.register()  # as the Executor does: workers get worker copies
        for seq, w in zip(batch, pickle.loads(ForkingPickler.dumps(batch)), strict=True):
            end = w.num_computed_tokens
            start = end - w.num_new_tokens
            if proposals_of(w):
                inputs = [w.last_token] + proposals_of(w)
            elif w.num_new_tokens == 1 and end == w.num_tokens:
                inputs = [w.last_token]
            else:
                inputs = w.token_ids[start:end]
            known = seq.token_ids
            expected = SEED
            for t in known[:start]:
                expected = mix(expected, t)
            v = SEED if start == 0 else self.kv[self.slot(w, start - 1)]
            assert v == expected, f"{seq}: context K/V is not its own tokens' chain"
            predictions = []
            for pos, token in enumerate(inputs, start):
                v = mix(v, token)
                self.kv[self.slot(w, pos)] = v
                predictions.append(v % VOCAB)
            if end < w.num_tokens:
                continue  # a prompt chunk short of its end samples nothing
            if proposals_of(w):
                accepted = 0
                while (accepted < len(proposals_of(w))
                       and proposals_of(w)[accepted] == predictions[accepted]):
                    accepted += 1
                verified[len(samplers)] = proposals_of(w)[:accepted] + [predictions[accepted]]
                event(f"accepted {accepted} of {len(proposals_of(w))}")
            samplers.append(seq)
            tokens.append(predictions[-1])
        return samplers, tokens, verified


def check_invariants(sch: Scheduler) -> None:
    bm = sch.block_manager
    free = list(bm.free_block_ids)
    assert len(free) == len(set(free)) and set(free).isdisjoint(used_block_ids(bm))
    assert set(free) | used_block_ids(bm) == set(range(len(bm.blocks)))
    holders = [0] * len(bm.blocks)
    for s in sch.running:
        for b in s.block_table:
            holders[b] += 1
    assert [b.ref_count for b in bm.blocks] == holders
    for h, b in bm.hash_to_block_id.items():
        assert bm.blocks[b].hash == h
    for s in sch.running:
        assert proposals_of(s) == []
        assert len(s.block_table) <= s.num_blocks, f"{s}: holds a block past its tokens"
        for i, block_id in enumerate(s.block_table):
            block = bm.blocks[block_id]
            if i < len(s.block_hashes):  # registered: the sequence's own tokens
                assert block.hash == s.block_hashes[i] and block.token_ids == s.block(i)
            elif block.ref_count == 1:  # its own fresh block: unregistered
                assert block.hash == -1, f"{s}: block {i} registered past its known tokens"


@st.composite
def workloads(draw: st.DrawFn) -> tuple[Config, list[tuple[list[int], int]]]:
    block_size = draw(st.integers(1, 6))
    token = st.integers(0, VOCAB - 1)
    base = draw(st.lists(token, min_size=1, max_size=20))
    requests = []
    for _ in range(draw(st.integers(1, 6))):
        prompt = (base if draw(st.booleans()) else []) + draw(st.lists(token, max_size=12))
        requests.append((prompt or [0], draw(st.integers(1, 24))))
    max_model_length = max(len(p) for p, _ in requests) + draw(st.integers(1, 30))
    longest = max(min(len(p) + m, max_model_length) for p, m in requests)
    chunked = draw(st.booleans())
    config = Config(
        block_size=block_size, max_model_length=max_model_length,
        num_kvcache_blocks=math.ceil(longest / block_size) + draw(st.integers(0, 12)),
        # prefill-first: a preempted sequence must fit one step again, whole
        max_num_batched_tokens=draw(st.integers(4 if chunked else longest, 64 + longest)),
        max_num_sequences=draw(st.integers(1, 4)),
        enable_prefix_caching=draw(st.booleans()), enable_chunked_prefill=chunked,
        speculative_method="ngram", num_speculative_tokens=draw(st.integers(1, 5)),
        prompt_lookup_min=1, prompt_lookup_max=draw(st.integers(1, 4)), eos=-1)
    return config, requests


@SETTINGS
@given(workloads())
def test_speculative_bookkeeping_matches_plain_decoding(
        workload: tuple[Config, list[tuple[list[int], int]]]) -> None:
    config, requests = workload
    sch = Scheduler(config)
    runner = FakeVerifier(config.block_size)
    seqs = []
    for prompt, max_tokens in requests:
        seq = Sequence(prompt, config.block_size,
                       SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        sch.add_sequence(seq)
        seqs.append(seq)
    steps = 0
    while not sch.is_finished():
        batch, _ = sch.schedule()
        assert batch and sum(s.num_new_tokens for s in batch) <= config.max_num_batched_tokens
        if any(s.num_completion_tokens for s in sch.waiting):
            event("preemption")
        samplers, tokens, verified = runner.run(batch)
        for seq in samplers:
            add_pending_token(seq)  # as EngineCore.step does
        sch.postprocess(samplers, tokens, verified)
        check_invariants(sch)
        steps += 1
        assert steps < 10_000
    assert all(b.ref_count == 0 for b in sch.block_manager.blocks)
    assert len(sch.block_manager.free_block_ids) == len(sch.block_manager.blocks)
    for seq, (prompt, max_tokens) in zip(seqs, requests, strict=True):
        assert seq.status == SequenceStatus.FINISHED
        assert seq.completion_token_ids == run_alone(prompt, max_tokens,
                                                     config.max_model_length)
    stats = sch.speculator.stats if sch.speculator is not None else None
    assert stats is not None and stats.num_accepted_tokens <= stats.num_draft_tokens
