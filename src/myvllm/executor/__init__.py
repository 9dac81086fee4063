"""Tensor parallelism's processes (the guide's Features, "Tensor parallelism"): an engine of one
rank has none of this, its EngineCore calls its ModelRunner itself.

    executor.py          Executor: rank 0's calls sent to every worker, a death noticed
    tp_workers.py        worker processes: ranks 1..N-1 of the ModelRunner
    tp_launch.py         ranks started by torchrun, on one host or several
    tp_watchdog.py       rank 0 notices a dead worker within a second
    sequence_pickling.py what of a Sequence travels to the workers each step
    errors.py            EngineDeadError: the engine can run no more requests
"""
