"""Sampling beyond the plain path (the guide's Step 1 sampler is layers/sampler.py; each row's
SamplingParams become the sampler's per-row arguments in engine/model_runner.py's
prepare_sample):

    extras.py             SequenceExtras: the per-request state of the optional features
                          (Sequence.extras; None for a plain request)
    sampling_controls.py  penalties, min_p, logit_bias, min_tokens, stop token ids
    logits_features.py    what acts on or reads a step's logits: controls, grammar, logprobs
    logprobs.py           logprobs from the device to a request's output
    forks.py              n > 1: a request's other completions, forked after its prefill
    finished_outputs.py   logprobs and n > 1 completions gathered until their request ends

The guide's part "Features, one at a time" teaches each; none of it runs for a plain
request.
"""
