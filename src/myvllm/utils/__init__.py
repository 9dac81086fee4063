"""Helpers below the engine: the per-step context the layers read (context.py, Step 4),
checkpoint and model-path finding, loading (loader.py, Step 2), devices, collectives for
tensor parallelism (distributed.py), and the garbage collector's pause (gc_freeze.py).
"""
