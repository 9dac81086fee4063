"""The engine's core, the part a learner reads (the guide's Steps 3, 5 and 6, and Step 4's
ModelRunner): what a plain request runs, and nothing a feature adds.

    sequence.py       Sequence: one request's tokens, status and block table (Step 3)
    block_manager.py  BlockManager: blocks, reference counts, prefix caching (Step 3)
    scheduler.py      Scheduler: waiting/running, prefill or chunks, preemption (Step 5),
                      under one step's token budget (StepBudget, Step 5b)
    model_runner.py   ModelRunner: one step of the model, a token per sequence (Step 4)
    core.py           EngineCore: schedule -> run -> postprocess, one step at a time (Step 6)
    llm_engine.py     LLMEngine (myvllm.LLM): text in, text out, in your process (Step 6)

beside them the request checks (request_checks.py, and scheduler_view.py: what of the
Scheduler they read), a capped chunk's length (capped_chunks.py), the step's typed objects
(batch.py), the outputs, start-up (startup.py; core_parts.py builds the core's parts in
order) and async scheduling's steps in flight (queued_steps.py). Features reach the core as objects
it is handed (None when off): the packages worker/, sample/, spec_decode/,
structured_output/ and executor/.

Nothing is imported here on purpose: ``engine.sequence``, ``engine.block_manager`` and
``engine.scheduler`` are plain Python (no torch), and importing the package must not pull in
the model runner and its GPU dependencies.
"""
