"""The ModelRunner's machinery (the guide's Step 4; the core's runner is engine/model_runner.py):

    input_builder.py   a scheduled batch -> the tensors of one forward (prepare_prefill/decode)
    feature_step.py    a step with a row that has extras: the features beside the plain path
    staging.py         host arrays -> device tensors; a step's tokens on their way back
    kv_cache.py        how many KV-cache blocks fit, and the cache tensors
    model_loading.py   the checkpoint's model class, built and loaded (fused on a GPU)
    cpu_threads.py     torch threads on a CPU

and what serves speed (the guide's "From correct to fast"): warmup.py (the KV cache sized on
every device; on a GPU, warm-ups, then padding and graph capture), cuda_graphs.py,
padded_steps.py and static_buffers.py (GPU steps on fixed buffers that graphs replay),
token_pool.py and pending_tokens.py (sampled tokens kept on the device, and async scheduling's
tokens not yet on the host: a GPU's, or any device's under async scheduling).
"""
