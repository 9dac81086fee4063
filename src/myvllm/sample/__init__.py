"""Sampling beyond the plain path (the guide's Step 1 sampler is layers/sampler.py):

    sampling.py           each row's SamplingParams as the sampler's per-row arguments
    extras.py             SequenceExtras: the per-request state of the optional features
                          (Sequence.extras; None for a plain request)
    sampling_controls.py  penalties, min_p, logit_bias, min_tokens, stop token ids
    logits_features.py    what acts on or reads a step's logits: controls, grammar, logprobs
    logprobs.py           logprobs from the device to a request's output
    forks.py              n > 1: a request's other completions, forked after its prefill

The guide's part "Features, one at a time" teaches each; only sampling.py runs for a plain
request.
"""
