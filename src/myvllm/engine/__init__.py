"""Steps 3-6: Sequence and BlockManager (step 3), ModelRunner (step 4), Scheduler (step 5),
EngineCore and its clients, LLMEngine and AsyncLLM (step 6).

Nothing is imported here on purpose: ``engine.sequence``, ``engine.block_manager`` and
``engine.scheduler`` are plain Python (no torch), and importing the package must not pull in
the model runner and its GPU dependencies.
"""
