"""Helpers below the engine: the per-step context the layers read (context.py, Step 4),
checkpoint and model-path finding, loading (loader.py, Step 2), devices, collectives for
tensor parallelism (distributed.py), the garbage collector's pause (gc_freeze.py), and the
exit of the engine's own processes without the interpreter's (process_exit.py).
"""
