"""The draft-model proposer (speculative_method="draft"): a second, smaller model with the
target's vocabulary proposes the next k tokens, one decode step each.

Where it runs: the scheduler reserves k proposal slots for a decode row (Speculator.propose
returns placeholders, so the row's lookahead blocks are allocated as for prompt lookup), and
the model runner asks the draft to fill them (DraftProposer.propose) just before the
target's verification step. The draft is a ModelRunner of its own (on a GPU with CUDA graphs
of its own: its one-token steps replay decode graphs, its catch-up chunks chunk graphs, as
the target's steps do), with a KV cache of its own that has the target's number of blocks
and block size and is indexed by the target's block tables:

    target cache   block 7: K/V of the target's layers for positions 8..11 of sequence s
    draft cache    block 7: K/V of the draft's layers for the same positions of s

So the block manager needs no change: a block freed or rolled back frees both, and the
memory sizing counts both caches per block (ModelRunner.initialize_cache).

One proposing step for a sequence of n tokens t_1..t_n, the draft having seen m of them:

    catch-up   the draft runs over t_{m+1}..t_n (a prefill of the whole sequence the first
               time; then the tokens the last verification emitted)  -> q_1, d_1 ~ q_1
    decode     d_1 .. d_{k-1} one at a time, at positions n .. n+k-2 -> q_2..q_k, d_2..d_k

all rows of the step batched. Afterwards the draft counts n tokens seen: the K/V of t_1..t_n
hold whatever is accepted, while those of d_1..d_{k-1} sit in slots the verification may
reject (the next catch-up rewrites the accepted ones). q_j is the distribution d_j was drawn
from, shaped by the request's temperature, top-k and top-p as the target's p is; the
rejection sampler accepts d_j with min(1, p/q) and resamples from max(0, p - q). A greedy
row proposes the draft's argmax and is verified by exact match.

Prefix caching: a block the target found in the prefix cache was written by the target for
some sequence whose draft may never have run over it, so its draft K/V cannot be trusted.
A new sequence therefore starts with m = 0 (the draft recomputes from position 0 and
writes the same K/V that any other sequence's draft writes at those positions), and so does
a sequence after a preemption (Sequence.num_preemptions), whose blocks may be new.
"""

from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass
from typing import Any, cast

import torch

from myvllm.config import Config
from myvllm.engine.model_runner import ModelRunner, prepare_sample
from myvllm.sample.extras import proposals_of
from myvllm.sample.sampling_controls import generator_for
from myvllm.engine.sequence import Sequence
from myvllm.spec_decode.rejection_sampler import target_probs
from myvllm.utils.hf_config import load_hf_config



@dataclass
class DraftState:
    """What the draft holds of one sequence: the K/V of its first num_seen tokens."""

    num_seen: int = 0
    num_preemptions: int = 0  # the sequence's count when num_seen was last valid


class DraftRow:
    """A stand-in for a sequence that the draft's runner reads as a prefill chunk (the
    fields InputBuilder.prepare_prefill reads): its tokens, the target's block table (the
    draft's cache is indexed by it), and the draft's own counts."""

    extras = None  # no feature's state: the draft's chunks verify nothing
    num_pending_tokens = 0  # every token on the host

    def __init__(self, token_ids: list[int], block_table: list[int]) -> None:
        self.token_ids = token_ids
        self.block_table = block_table
        self.num_computed_tokens = 0  # the chunk's end
        self.num_new_tokens = 0  # the chunk's length

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)


class DraftProposer:
    def __init__(self, config: Config, target_hf_config: Any) -> None:
        assert config.speculative_model is not None
        path = str(config.speculative_model)
        hf_config = load_hf_config(path)
        # Before any weight is read: the draft's token ids must mean the target's.
        if hf_config.vocab_size != target_hf_config.vocab_size:
            raise ValueError(
                f"Config.speculative_model={path!r} has a vocabulary of "
                f"{hf_config.vocab_size} tokens, the target model one of "
                f"{target_hf_config.vocab_size}: the draft must share the target's vocabulary")
        draft_config = dataclasses.replace(config, speculative_method=None,
                                           speculative_model=None)
        self.runner: ModelRunner = ModelRunner(draft_config, 0, path, hf_config)
        # Its decode graphs stop at the hidden states: q needs the logits of every step.
        self.runner.sample_in_graph = False
        self.max_chunk_tokens = config.max_num_batched_tokens
        self.states: weakref.WeakKeyDictionary[Sequence, DraftState] = (
            weakref.WeakKeyDictionary())

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of the draft's cache (over its layers, K and V)."""
        return self.runner.kv_layout.block_bytes

    def warm_up(self) -> None:
        """GPU, before the target's warm-up (which then measures the peak the KV caches are
        sized by): the draft's kernels' variants compiled now, not in the first request. Its
        activations fit within the target's peak: its chunks are bounded by the same
        max_num_batched_tokens, and a draft is the smaller model."""
        from myvllm.worker import warmup
        warmup.warmup_model(self.runner)

    def allocate_cache(self, num_blocks: int) -> None:
        """The draft's cache, num_blocks as the target's; on a GPU then its CUDA graphs."""
        from myvllm.worker import warmup
        from myvllm.worker.kv_cache import allocate_kv_cache
        runner = self.runner
        runner.k_cache, runner.v_cache = allocate_kv_cache(
            runner.attention_layers, runner.kv_layout, num_blocks, runner.device)
        runner.num_kvcache_blocks = num_blocks
        if runner.device.type == "cuda":
            warmup.warmup_cached_prefix_prefill(runner)
            warmup.pad_and_capture(runner)

    def state(self, seq: Sequence) -> DraftState:
        state = self.states.get(seq)
        if state is None or state.num_preemptions != seq.num_preemptions:
            state = self.states[seq] = DraftState(0, seq.num_preemptions)
        return state

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence]) -> torch.Tensor | None:
        """Fill the proposal slots (extras.spec_token_ids) of the step's rows that have them, in
        place. Returns q [rows with proposals, k, vocab] (k: the most any row has; a row
        with fewer padded with zeros), or None when no row proposes."""
        rows = [seq for seq in seqs if proposals_of(seq)]
        if not rows:
            return None
        k = max(len(proposals_of(seq)) for seq in rows)
        logits = self._catch_up(rows)
        vocab = logits.size(-1)
        q = torch.zeros(len(rows), k, vocab, dtype=torch.float32, device=logits.device)
        shadows: dict[int, DraftRow] = {}  # made when a row first takes a draft token
        active = list(range(len(rows)))  # rows that still want a proposal
        for j in range(k):
            tokens = self._sample(logits, [rows[i] for i in active], q, active, j)
            for i, token in zip(active, tokens, strict=True):
                proposals_of(rows[i])[j] = token
            active = [i for i in active if len(proposals_of(rows[i])) > j + 1]
            if not active:
                break
            batch = []
            for i in active:  # d_{j+1} in at its position, for q_{j+2}
                if i not in shadows:  # its own copy of the tokens: drafts get appended
                    shadows[i] = DraftRow(list(rows[i].token_ids), rows[i].block_table)
                shadow = shadows[i]
                shadow.append_token(proposals_of(rows[i])[j])
                batch.append(shadow)
            logits = self._decode(batch)
        for seq in rows:
            self.state(seq).num_seen = seq.num_tokens
        return q

    def _catch_up(self, rows: list[Sequence]) -> torch.Tensor:
        """Run the draft over each row's unseen tokens, in chunks of at most
        max_num_batched_tokens a step (the draft's activations then stay within the peak
        the target's warm-up measured); returns the logits after each row's last token."""
        last: list[torch.Tensor | None] = [None] * len(rows)
        seen = [min(self.state(seq).num_seen, seq.num_tokens - 1) for seq in rows]
        while any(s < seq.num_tokens for s, seq in zip(seen, rows, strict=True)):
            batch, at, budget = [], [], self.max_chunk_tokens
            for i, seq in enumerate(rows):
                todo = min(seq.num_tokens - seen[i], budget)
                if todo <= 0:
                    continue
                # Read only (nothing is appended): the sequence's own token list, not a copy.
                shadow = DraftRow(seq.token_ids, seq.block_table)
                seen[i] += todo
                budget -= todo
                shadow.num_computed_tokens, shadow.num_new_tokens = seen[i], todo
                batch.append(shadow)
                at.append(i)
            logits = self._forward(batch)
            for row, i in enumerate(at):
                if seen[i] == rows[i].num_tokens:
                    last[i] = logits[row]
        return torch.stack([t for t in last if t is not None])

    def _decode(self, shadows: list[DraftRow]) -> torch.Tensor:
        """One token per row (each row's last, at position len - 1), as a decode step: on
        a GPU the draft's decode graph for the padded batch -> the logits of each row."""
        runner, block_size = self.runner, self.runner.config.block_size
        positions = [len(shadow) - 1 for shadow in shadows]
        # By position: the target's table may already hold blocks past the draft's token.
        slots = [shadow.block_table[p // block_size] * block_size + p % block_size
                 for shadow, p in zip(shadows, positions, strict=True)]
        step = runner.inputs.decode_rows(
            [shadow.last_token for shadow in shadows], [], positions, slots,
            [len(shadow) for shadow in shadows], [0.0] * len(shadows),
            [shadow.block_table for shadow in shadows])
        # All (padded) rows, as in the target's decode step; the batch's rows first.
        logits = runner.decode_logits(step)
        assert logits is not None  # rank 0 (a draft runs on one GPU)
        return logits[:len(shadows)].float()

    def _forward(self, shadows: list[DraftRow]) -> torch.Tensor:
        # A DraftRow has every field of a Sequence that a prefill step reads.
        logits = self.runner.forward_prefill(cast(list[Sequence], shadows))
        assert logits is not None  # rank 0
        return logits.float()

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence], q: torch.Tensor,
                rows: list[int], j: int) -> list[int]:
        """The draft's token for each of seqs (its argmax when greedy, else a draw from q,
        the distribution the request's settings make of its logits); q[rows, j] set, except
        when every row is greedy: a greedy row is verified by exact match, its q never read."""
        if all(seq.sampling_params.temperature == 0 for seq in seqs):
            return [int(t) for t in logits.argmax(dim=-1).tolist()]
        device = logits.device
        # The settings as the Sampler and the rejection sampler read them (the same p).
        args = prepare_sample(seqs, self.runner.inputs.fresh.tensor, device)
        temperatures = args.temperatures
        probs = target_probs(logits.unsqueeze(1), temperatures, args.top_ks,
                             args.top_ps).squeeze(1)
        q[rows, j] = probs
        noise = torch.empty_like(probs).exponential_()
        for row, seq in enumerate(seqs):
            generator = generator_for(seq, device)
            if generator is not None:  # a seeded row draws from its own generator alone
                noise[row].exponential_(generator=generator)
        sampled = (probs / noise.clamp_min_(1e-10)).argmax(dim=-1)  # a draw from probs
        tokens = torch.where(temperatures == 0, logits.argmax(dim=-1), sampled)
        return [int(t) for t in tokens.tolist()]


def make_draft_proposer(config: Config, target_hf_config: Any) -> DraftProposer | None:
    return (DraftProposer(config, target_hf_config)
            if config.speculative_method == "draft" else None)
