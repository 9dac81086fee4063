"""Speculative decoding: propose a few tokens cheaply, verify them in one forward pass, keep
the ones the target model would have produced itself.

    ngram_proposer.py      NgramProposer: prompt lookup, the proposals copied from earlier in
                           the sequence (host only, no model)
    draft_proposer.py      DraftProposer: a small model of the target's vocabulary proposes,
                           with a KV cache of its own read through the target's block tables
    scheduling.py          the scheduler's side: how many proposals a decode row may carry,
                           and what an accepted count does to the sequence and its blocks
    verification.py        the model runner's side: which rows' logits a step needs, and
                           the rejection sampler run on them
    rejection_sampler.py   rejection sampling that keeps the target distribution exactly
    stats.py               SpecDecodeStats: proposals and acceptances, for /metrics
"""
