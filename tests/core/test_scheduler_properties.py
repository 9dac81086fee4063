"""Property tests: Scheduler + BlockManager driven by a fake model over random workloads.

The fake model keeps a simulated paged KV cache, one value per slot. Like a real
transformer, the "K/V" of position p depends on its token AND on everything before it,
which it reads from the cache through the block table:

    kv[p] = mix(kv[p - 1], token[p])        next token = kv[last] % VOCAB

So a wrong block table, a cached block reused after a different prefix, a shared block
overwritten while another sequence reads it, or a token lost in preemption changes the
values read, and the sequence's output diverges from what the model gives it run alone.
The values read are also compared with the expected chain directly, for a precise failure.
The runner works on pickled copies of the sequences, as tensor-parallel workers do.

After every schedule() and postprocess() the bookkeeping invariants are checked: free and
used blocks partition the pool, every ref_count equals the number of running block tables
holding the block, cached hashes point at blocks that hold them, no sequence is lost.
Requests of n > 1 completions (greedy here) must give n copies of what the model gives
the prompt alone, whichever way their forks share the prompt's blocks.

Examples per property: MYVLLM_HYPOTHESIS_EXAMPLES (default 100).
"""

from __future__ import annotations

import math
import os
import pickle
import struct
import zlib
from dataclasses import dataclass

from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from myvllm.config import Config
from myvllm.sample.forks import can_fork, fork_source, make_forks, num_shared_prompt_blocks
from myvllm.engine.block_manager import compute_hash
from myvllm.engine.scheduler import Scheduler
from myvllm.engine.sequence import Sequence, SequenceStatus
from myvllm.sampling_parameters import SamplingParams
from myvllm.worker.pending_tokens import add_pending_token
from helpers_blocks import used_block_ids

VOCAB = 16
EOS = 0  # the fake model emits it about once in VOCAB tokens
SEED = 12345  # "kv[-1]"

SETTINGS = settings(
    max_examples=int(os.environ.get("MYVLLM_HYPOTHESIS_EXAMPLES", "100")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def mix(prev: int, token: int) -> int:
    return zlib.crc32(struct.pack("<qq", prev, token))


def kv_chain(tokens: list[int]) -> list[int]:
    out, v = [], SEED
    for t in tokens:
        v = mix(v, t)
        out.append(v)
    return out


def run_alone(prompt: list[int], params: SamplingParams, max_model_length: int) -> list[int]:
    """What the fake model generates for this prompt with nobody else around."""
    tokens = list(prompt)
    v = kv_chain(prompt)[-1]
    while True:
        t = v % VOCAB
        tokens.append(t)
        if ((not params.ignore_eos and t == EOS) or len(tokens) - len(prompt) >= params.max_tokens
                or len(tokens) >= max_model_length):
            return tokens[len(prompt):]
        v = mix(v, t)


class FakeRunner:
    """Stands in for ModelRunner.run(): a slot -> value 'KV cache' and the fake model.

    Like the real runner it remembers the tokens it sampled last: under overlapped
    scheduling a sequence's last token may still be pending (unknown to the host), and the
    runner feeds it from there.
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.kv: dict[int, int] = {}
        self.last_sampled: dict[int, int] = {}  # seq_id -> token of the last step

    def slot(self, seq: Sequence, pos: int) -> int:
        return seq.block_table[pos // self.block_size] * self.block_size + pos % self.block_size

    def read(self, seq: Sequence, pos: int) -> int:
        return SEED if pos < 0 else self.kv.get(self.slot(seq, pos), -1)

    def tokens(self, seq: Sequence) -> list[int]:
        """All of seq's tokens, a pending one included (at most one is pending here)."""
        assert seq.num_pending_tokens <= 1, seq
        return seq.token_ids + ([self.last_sampled[seq.seq_id]] if seq.num_pending_tokens else [])

    def run(self, seqs: list[Sequence], is_prefill: bool, sch: Scheduler) -> list[int]:
        bm = sch.block_manager
        written: set[int] = set()
        out = []
        overlapped = any(seq.num_pending_tokens for seq in seqs)
        # What a tensor-parallel worker receives: prefill -> all tokens, decode -> last only.
        # (Overlapped scheduling runs on rank 0 alone, with the sequences themselves.)
        workers = seqs if overlapped else pickle.loads(pickle.dumps(seqs))
        for w in workers:
            assert len(w.block_table) == w.num_blocks, w
            if is_prefill:
                assert 0 <= w.num_cached_tokens < len(w), w  # always computes >= 1 token
                assert w.num_cached_tokens % self.block_size == 0
                start = w.num_cached_tokens
                new_tokens = w.token_ids[start:]
            else:
                start = len(w) - 1
                new_tokens = [self.tokens(w)[-1] if w.num_pending_tokens else w.last_token]
            v = self.read(w, start - 1)  # the cached context this pass builds on
            for pos, token in enumerate(new_tokens, start):
                block_id = w.block_table[pos // self.block_size]
                if not is_prefill:  # decode writes only into a block nobody else reads
                    assert bm.blocks[block_id].ref_count == 1, (w, block_id)
                written.add(block_id)
                v = mix(v, token)
                self.kv[self.slot(w, pos)] = v
            out.append(v % VOCAB)
        # a prefill writes only into blocks of this batch (fresh ones, maybe shared within it)
        for other in sch.running:
            if all(other is not s for s in seqs):
                assert written.isdisjoint(other.block_table), other
        for seq in seqs:
            values = [self.read(seq, p) for p in range(len(seq))]
            assert values == kv_chain(self.tokens(seq)), f"{seq}: wrong K/V in the cache"
        self.last_sampled = {seq.seq_id: t for seq, t in zip(seqs, out)}
        return out

    def run_chunks(self, seqs: list[Sequence], sch: Scheduler) -> list[int]:
        """A chunked-prefill step: each sequence computes the num_new_tokens tokens below its
        num_computed_tokens, reading what is before them from the cache."""
        out = []
        overlapped = any(seq.num_pending_tokens for seq in seqs)
        workers = seqs if overlapped else pickle.loads(pickle.dumps(seqs))
        for seq, w in zip(seqs, workers):
            assert len(w.block_table) == w.num_blocks, w
            end = w.num_computed_tokens
            start = end - w.num_new_tokens
            assert 0 <= start < end <= len(w), w
            if w.num_new_tokens == 1 and end == len(w):
                new_tokens = [self.tokens(seq)[-1] if w.num_pending_tokens else w.last_token]
            else:
                new_tokens = w.token_ids[start:end]
            v = self.read(w, start - 1)
            for pos, token in enumerate(new_tokens, start):
                v = mix(v, token)
                self.kv[self.slot(w, pos)] = v
            out.append(v % VOCAB)
        for seq in seqs:
            computed = self.tokens(seq)[: seq.num_computed_tokens]
            values = [self.read(seq, p) for p in range(seq.num_computed_tokens)]
            assert values == kv_chain(computed), f"{seq}: wrong K/V in the cache"
        self.last_sampled = {seq.seq_id: t for seq, t in zip(seqs, out)}
        return out


def chain_hashes(tokens: list[int], block_size: int, num_full: int) -> list[int]:
    hashes, h = [], -1
    for i in range(num_full):
        h = compute_hash(tokens[i * block_size:(i + 1) * block_size], h)
        hashes.append(h)
    return hashes


def forks_of(seq: Sequence) -> list[Sequence]:
    """The other completions seq still holds (n > 1)."""
    return seq.extras.forks if seq.extras is not None else []


def check_invariants(sch: Scheduler, seqs: list[Sequence], scheduled: list[Sequence],
                     caching: bool, chunked: bool = False) -> None:
    bm = sch.block_manager
    bs = bm.block_size
    n = len(bm.blocks)
    free = list(bm.free_block_ids)
    assert len(free) == len(set(free)), "a block is twice in the free list"
    assert set(free).isdisjoint(used_block_ids(bm))
    assert set(free) | used_block_ids(bm) == set(range(n))

    # every sequence is in exactly one place, with a matching status
    waiting_ids = [s.seq_id for s in sch.waiting]
    running_ids = [s.seq_id for s in sch.running]
    assert len(set(waiting_ids) | set(running_ids)) == len(waiting_ids) + len(running_ids)
    assert len(sch.running) <= sch.max_num_sequences
    for s in seqs:
        # a fork not yet released by its first completion is in neither queue
        source = s.extras.fork_source if s.extras is not None else None
        held = source is not None and any(f is s for f in forks_of(source))
        where = (s.seq_id in waiting_ids or held, s.seq_id in running_ids, s.is_finished)
        assert sum(where) == 1, (s, where)
        if s.status != SequenceStatus.RUNNING:
            assert s.block_table == [], s
        if s.status == SequenceStatus.WAITING:
            assert s.num_cached_tokens == 0 and s.needs_prefill, s
        assert s.status == (SequenceStatus.WAITING if where[0] else
                            SequenceStatus.RUNNING if where[1] else SequenceStatus.FINISHED)

    # ref counts = number of running block tables holding the block
    holders = [0] * n
    for s in sch.running:
        for b in s.block_table:
            holders[b] += 1
    for block in bm.blocks:
        assert block.ref_count == holders[block.block_id], block
    
    # the cache index only names blocks that hold that hash, and only full blocks are hashed
    for h, b in bm.hash_to_block_id.items():
        assert bm.blocks[b].hash == h
    for block in bm.blocks:
        if block.hash != -1:
            assert len(block.token_ids) == bs
    if not caching:
        assert not bm.hash_to_block_id and all(b.hash == -1 for b in bm.blocks)

    scheduled_ids = {s.seq_id for s in scheduled}
    for s in sch.running:
        # tokens whose K/V is in the cache or written in the step just scheduled
        covered = len(s) if s.seq_id in scheduled_ids else len(s) - 1
        if chunked:  # part-way prompts: only what the steps so far computed
            covered = s.num_computed_tokens
        assert math.ceil(covered / bs) <= len(s.block_table) <= s.num_blocks, s
        if caching:
            # a block with a pending token is registered once the token is known
            full = min(covered, len(s.token_ids)) // bs
            for i, h in enumerate(chain_hashes(s.token_ids, bs, full)):
                block = bm.blocks[s.block_table[i]]
                assert block.hash == h and block.token_ids == s.block(i), (s, i)
        else:  # only a fork starts with K/V it did not compute: its prompt's full blocks
            shared = num_shared_prompt_blocks(s) * bs if s.index else 0
            assert s.num_cached_tokens in (0, shared), s


@dataclass
class Request:
    arrival: int
    prompt: list[int]
    params: SamplingParams
    streamed: bool = True  # False: its tokens come back at the end (as in generate())


@st.composite
def workloads(draw: st.DrawFn) -> tuple[dict, list[Request]]:
    block_size = draw(st.integers(1, 16))
    caching = draw(st.booleans())
    tokens = st.integers(0, VOCAB - 1)
    max_base = min(4 * block_size + 2, 40)
    bases = draw(st.lists(st.lists(tokens, max_size=max_base), min_size=1, max_size=3))
    # whole blocks reused after different prefixes: hits must depend on the prefix too
    chunks = draw(st.lists(st.lists(tokens, min_size=block_size, max_size=block_size),
                           min_size=1, max_size=3))
    bases += [sum(draw(st.lists(st.sampled_from(chunks), min_size=1, max_size=4)), [])
              for _ in range(2)]
    requests: list[Request] = []
    for _ in range(draw(st.integers(1, 10))):
        if requests and draw(st.integers(0, 3)) == 0:
            prompt = list(draw(st.sampled_from(requests)).prompt)  # an exact repeat
        else:
            base = draw(st.sampled_from(bases))
            cut = len(base) if draw(st.booleans()) else draw(st.integers(0, len(base)))
            prompt = base[:cut] + draw(
                st.lists(tokens, max_size=2 * block_size + 1))
            if not prompt:
                prompt = [draw(tokens)]
        params = SamplingParams(temperature=0.0, max_tokens=draw(st.integers(1, 20)),
                                ignore_eos=draw(st.booleans()),
                                n=draw(st.sampled_from([1, 1, 2, 3])))
        requests.append(Request(draw(st.integers(0, 12)), prompt, params, draw(st.booleans())))
    requests.sort(key=lambda r: r.arrival)
    longest_prompt = max(len(r.prompt) for r in requests)
    max_model_length = longest_prompt + draw(st.integers(1, 20))  # room for one token

    def footprint(r: Request) -> int:  # most tokens it ever needs in the cache
        longest = min(len(r.prompt) + r.params.max_tokens, max_model_length)
        return max(len(r.prompt), longest - 1)

    need = max(math.ceil(footprint(r) / block_size) for r in requests)
    config = dict(
        block_size=block_size,
        enable_prefix_caching=caching,
        max_model_length=max_model_length,
        # tiny pools: at most a few blocks more than the largest request; sometimes fewer,
        # and then that request must be rejected up front
        num_kvcache_blocks=max(1, need + draw(st.integers(-1, 3))),
        max_num_batched_tokens=max(1, max(footprint(r) for r in requests)
                                   + draw(st.integers(-3, 40))),
        max_num_sequences=draw(st.integers(1, 6)),
        # chunked only: a cap on prompt tokens beside decode rows (0 = none)
        max_prefill_tokens_while_decoding=draw(st.sampled_from([0, 1, 3, 7, 512])),
        eos=EOS,
    )
    return config, requests


def drive(config_kw: dict, requests: list[Request], overlapped: bool = False,
          chunked: bool = False) -> None:
    """Run the workload to the end, checking every step.

    overlapped: as LLMEngine with async_scheduling, schedule and run step N+1 before step
    N's tokens are handed to postprocess (each sequence of a step counts a pending token).
    chunked: the token-budget scheduler (enable_chunked_prefill); otherwise prefill-first.
    """
    config = Config(**config_kw, enable_chunked_prefill=chunked)
    sch = Scheduler(config)
    bs = config.block_size
    runner = FakeRunner(bs)
    caching = config.enable_prefix_caching
    accepted: list[tuple[Sequence, Request]] = []
    pending = list(requests)
    step = 0
    max_steps = 20 * sum(len(r.prompt) + r.params.max_tokens for r in requests) + 50
    in_flight: tuple[list[Sequence], list[int]] | None = None
    while pending or not sch.is_finished() or in_flight:
        while pending and pending[0].arrival <= step:
            r = pending.pop(0)
            seq = Sequence(r.prompt, bs, r.params)
            seq.streamed = r.streamed
            longest = min(len(r.prompt) + r.params.max_tokens, config.max_model_length)
            fp = max(len(r.prompt), longest - 1)
            fits = (math.ceil(fp / bs) <= config.num_kvcache_blocks
                    and (chunked or fp <= config.max_num_batched_tokens))
            try:
                sch.add_sequence(seq)
                if r.params.n > 1:
                    make_forks(seq)  # as EngineCore.add_sequence does
            except ValueError:
                assert not fits, f"rejected a sequence that fits: {seq}"
                event("a request was rejected up front")
                continue
            assert fits, f"accepted a sequence that can never be prefilled: {seq}"
            accepted += [(s, r) for s in (seq, *forks_of(seq))]
            if forks_of(seq):
                event("n > 1 completions")
        if sch.is_finished() and not in_flight:
            step = pending[0].arrival if pending else step
            continue
        seqs = [s for s, _ in accepted]

        # rule 1: when the waiting head can be admitted, the step must be a prefill
        head = sch.waiting[0] if sch.waiting else None
        must_prefill = (head is not None and len(sch.running) < sch.max_num_sequences
                        and not head.num_pending_tokens
                        and len(head) <= sch.max_num_batched_tokens
                        and (can_fork(sch.block_manager, head) if fork_source(head)
                             else sch.block_manager.can_allocate(head)))
        num_running_before = len(sch.running)
        # the cap protects streams: sequences whose tokens someone reads as they come
        streams_decoding = any(s.streamed and s.num_tokens - s.num_computed_tokens <= 1
                               for s in sch.running)

        batch, is_prefill = sch.schedule()
        if not batch:
            # only while a step is in flight: its tokens decide what can run next
            assert in_flight, "schedule() returned an empty batch while work remains"
            event("overlapped: nothing to schedule until the step in flight is read")
            sch.postprocess(*in_flight)
            check_invariants(sch, seqs, [], caching, chunked)
            in_flight = None
            step += 1
            continue
        if chunked:
            assert sum(s.num_new_tokens for s in batch) <= sch.max_num_batched_tokens
            # While a streamed running sequence decodes, prompt chunks (rows that compute more
            # than their sequence's last token) share at most the cap.
            cap = config.max_prefill_tokens_while_decoding
            chunks = sum(s.num_new_tokens for s in batch
                         if s.num_new_tokens > 1 or s.num_computed_tokens != len(s))
            if streams_decoding and cap:
                assert chunks <= cap, "prompt chunks beside decode rows over the cap"
            elif cap and chunks > cap and any(s.num_new_tokens == 1 and s.num_computed_tokens
                                              == len(s) for s in batch):
                event("chunked: over the cap beside decode rows that nobody streams")
            assert len(batch) <= sch.max_num_sequences == config.max_num_sequences
            # a pure decode step computes exactly each sequence's last token
            assert is_prefill == any(s.num_new_tokens > 1 or s.num_computed_tokens != len(s)
                                     for s in batch)
            assert len({s.seq_id for s in batch}) == len(batch)
            check_invariants(sch, seqs, batch, caching, chunked)
            if any(0 < s.num_computed_tokens < s.num_tokens for s in batch):
                event("chunked: a prompt part-way through its prefill")
            if any(s.num_completion_tokens for s in sch.waiting):
                event("preemption")
            if any(s.num_cached_tokens for s in batch):
                event("prefix cache hit")
            if any(s.index and s.num_cached_tokens and not caching for s in batch):
                event("a fork shares its first completion's prompt blocks")
            tokens = runner.run_chunks(batch, sch)
            # only a sequence whose chunk reached its last token samples
            done = [(s, t) for s, t in zip(batch, tokens) if s.num_computed_tokens == len(s)]
            sampled = ([s for s, _ in done], [t for _, t in done])
            if overlapped:
                for seq in sampled[0]:
                    add_pending_token(seq)
                if in_flight:
                    sch.postprocess(*in_flight)
                in_flight = sampled
            else:
                sch.postprocess(*sampled)
            check_invariants(sch, seqs, [], caching, chunked)
            step += 1
            assert step < max_steps, "no termination"
            continue
        assert is_prefill == must_prefill
        if is_prefill:
            assert sum(len(s) for s in batch) <= sch.max_num_batched_tokens
            assert len(sch.running) <= sch.max_num_sequences
        else:
            # every running sequence decodes or was preempted (check_invariants: none lost)
            assert len(batch) <= num_running_before
            # in running order (a sequence skipped while its last token is in flight keeps
            # its place among them)
            assert [s for s in sch.running if s in batch] == batch
        check_invariants(sch, seqs, batch, caching)

        if any(s.num_completion_tokens for s in sch.waiting):
            event("preemption")
        if is_prefill and any(s.num_cached_tokens for s in batch):
            event("prefix cache hit")
        if any(s.index and s.num_cached_tokens and not caching for s in batch):
            event("a fork shares its first completion's prompt blocks")
        tokens = runner.run(batch, is_prefill, sch)
        if overlapped:
            for seq in batch:
                add_pending_token(seq)
            if in_flight:
                sch.postprocess(*in_flight)
            in_flight = (batch, tokens)
        else:
            sch.postprocess(batch, tokens)
        check_invariants(sch, seqs, [], caching)
        step += 1
        assert step < max_steps, "no termination"

    bm = sch.block_manager
    assert len(bm.free_block_ids) == len(bm.blocks) and not used_block_ids(bm)
    assert all(b.ref_count == 0 for b in bm.blocks)
    if any(s.completion_token_ids[-1] == EOS and not r.params.ignore_eos for s, r in accepted):
        event("a sequence stopped on eos")
    for seq, r in accepted:
        assert seq.is_finished
        assert seq.prompt_token_ids == r.prompt
        assert seq.completion_token_ids == run_alone(r.prompt, r.params, config.max_model_length)


@SETTINGS
@given(workloads())
@example(  # two requests that each need the whole pool, sharing a prefix: constant preemption
    (dict(block_size=2, enable_prefix_caching=True, max_model_length=20, num_kvcache_blocks=5,
          max_num_batched_tokens=20, max_num_sequences=4, eos=EOS),
     [Request(0, [1, 2, 3, 4, 5], SamplingParams(max_tokens=6, ignore_eos=True)),
      Request(0, [1, 2, 3, 4, 6], SamplingParams(max_tokens=6, ignore_eos=True)),
      Request(1, [1, 2, 3, 4], SamplingParams(max_tokens=6, ignore_eos=True))]))
@example(  # block_size 1: every token is a block
    (dict(block_size=1, enable_prefix_caching=True, max_model_length=12, num_kvcache_blocks=9,
          max_num_batched_tokens=12, max_num_sequences=3, eos=EOS),
     [Request(0, [3, 3, 3], SamplingParams(max_tokens=7, ignore_eos=True)),
      Request(0, [3, 3, 3], SamplingParams(max_tokens=7, ignore_eos=True)),
      Request(2, [3, 3], SamplingParams(max_tokens=7, ignore_eos=True))]))
@example(  # n = 3 without prefix caching in a pool that forces the forks' preemption
    (dict(block_size=2, enable_prefix_caching=False, max_model_length=20, num_kvcache_blocks=9,
          max_num_batched_tokens=20, max_num_sequences=4, eos=EOS),
     [Request(0, [1, 2, 3, 4, 5], SamplingParams(max_tokens=8, ignore_eos=True, n=3)),
      Request(1, [1, 2, 3], SamplingParams(max_tokens=6, ignore_eos=True, n=2))]))
def test_random_workloads(workload: tuple[dict, list[Request]]) -> None:
    drive(*workload)


@SETTINGS
@given(workloads())
@example(  # the two-requests-share-the-pool case above, with the steps overlapped
    (dict(block_size=2, enable_prefix_caching=True, max_model_length=20, num_kvcache_blocks=5,
          max_num_batched_tokens=20, max_num_sequences=4, eos=EOS),
     [Request(0, [1, 2, 3, 4, 5], SamplingParams(max_tokens=6, ignore_eos=True)),
      Request(0, [1, 2, 3, 4, 6], SamplingParams(max_tokens=6, ignore_eos=True)),
      Request(1, [1, 2, 3, 4], SamplingParams(max_tokens=6, ignore_eos=True))]))
def test_random_workloads_overlapped(workload: tuple[dict, list[Request]]) -> None:
    """The same properties when step N+1 is scheduled before step N's tokens are read
    (async scheduling): pending tokens, surplus steps after eos, late block registration."""
    drive(*workload, overlapped=True)


@SETTINGS
@given(workloads(), st.booleans())
@example(  # the two-requests-share-the-pool case above, chunked
    (dict(block_size=2, enable_prefix_caching=True, max_model_length=20, num_kvcache_blocks=5,
          max_num_batched_tokens=3, max_num_sequences=4, eos=EOS),
     [Request(0, [1, 2, 3, 4, 5], SamplingParams(max_tokens=6, ignore_eos=True)),
      Request(0, [1, 2, 3, 4, 6], SamplingParams(max_tokens=6, ignore_eos=True)),
      Request(1, [1, 2, 3, 4], SamplingParams(max_tokens=6, ignore_eos=True))]), True)
@example(  # n = 3 whose prompt runs in chunks of 3: the forks wait for its last chunk
    (dict(block_size=2, enable_prefix_caching=False, max_model_length=24, num_kvcache_blocks=12,
          max_num_batched_tokens=12, max_num_sequences=4, eos=EOS),
     [Request(0, [1, 2, 3, 4, 5, 6, 7], SamplingParams(max_tokens=6, ignore_eos=True, n=3))]),
    True)
def test_random_workloads_chunked(workload: tuple[dict, list[Request]],
                                  overlapped: bool) -> None:
    """The token-budget scheduler: no step over max_num_batched_tokens or max_num_sequences,
    every token computed once and in order (the cache holds the chain), no block leaked,
    every sequence finishes with the tokens it gets alone, with or without overlap. The
    budget is often far below a prompt's length here, so prompts run in many chunks."""
    config, requests = workload
    config = dict(config, max_num_batched_tokens=max(1, config["max_num_batched_tokens"] // 4))
    drive(config, requests, overlapped=overlapped, chunked=True)


def test_fake_model_emits_eos_sometimes() -> None:
    """Guard the generator: eos must actually occur, or the eos path goes untested."""
    outs = [run_alone([i, i + 1], SamplingParams(max_tokens=40), 100) for i in range(40)]
    assert any(o[-1] == EOS and len(o) < 40 for o in outs)
    assert any(len(o) == 40 for o in outs) or any(len(o) > 5 for o in outs)
