"""RequestFeatures: a Sequence's per-request state for the features a first reading skips.

Sequence derives from it, so each feature reads and writes its fields on the sequence itself;
all of it is rank 0's (a tensor-parallel worker's copy clears it: sequence_pickling.py) and
ends with the request.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from myvllm.serving.core_messages import LogprobsLists
from myvllm.sampling_parameters import SamplingParams

if TYPE_CHECKING:
    import torch

    from myvllm.engine.sequence import Sequence


class RequestFeatures:
    seq_id: int  # Sequence's

    def __init__(self, seq_id: int, sampling_params: SamplingParams) -> None:
        # Prompt logprobs still to compute (sample/logprobs.py): the prefill's LM head runs
        # over the prompt rows too (on every rank), and reads no prefix-cache hit (a cached
        # token has no logits). Cleared once all of them reached the host; the ones read back
        # so far wait in prompt_logprobs until an output carries them away.
        self.needs_prompt_logprobs: bool = sampling_params.prompt_logprobs is not None
        self.prompt_logprobs: LogprobsLists | None = (
            LogprobsLists([], [], []) if self.needs_prompt_logprobs else None)
        # The seeded generator, made at the first sampled step (sample/sampling.py).
        self.generator: torch.Generator | None = None
        # The prompt's distinct ids for repetition_penalty (sample/sampling_controls.py).
        self.penalty_prompt_ids: torch.Tensor | None = None
        # The grammar's matcher (structured_output/manager.py).
        self.grammar_matcher: Any = None
        # num_cached_tokens at the first admission: a re-prefill's hits on its own freed
        # blocks are no prompt hits.
        self.num_cached_prompt_tokens: int | None = None
        # Someone reads its tokens as they come: then the steps it decodes in stay short
        # (Config.max_prefill_tokens_while_decoding); generate() reads them at the end.
        self.streamed: bool = True
        # SamplingParams.n > 1 (sample/forks.py): the request this sequence is one completion
        # of (its first completion's seq_id), which completion it is, the others (held by the
        # first until its prefill's last chunk is scheduled) and, for those, the first.
        self.request_id: int = seq_id
        self.index: int = 0
        self.forks: list[Sequence] = []
        self.fork_source: Sequence | None = None
        # Recompute preemptions so far: a draft model's K/V of the sequence is then gone
        # (spec_decode/draft_proposer.py).
        self.num_preemptions: int = 0

    def check_grammar_accepts(self, token_id: int) -> None:
        """Advance the grammar's matcher, if any, past a sampled token."""
        if self.grammar_matcher is not None and not self.grammar_matcher.accept_token(token_id):
            # The sampler only picks tokens the matcher's bitmask allowed, so this is a bug.
            raise RuntimeError(f"sequence {self.seq_id}: token {token_id} was sampled but "
                               "its grammar does not accept it")
