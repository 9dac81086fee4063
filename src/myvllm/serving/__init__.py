"""The engine behind a server (the guide's Step 7): the engine core in a process of its own
and the clients that talk to it.

    async_llm.py      AsyncLLM: the engine as a stream of tokens for an asyncio event loop
    core_process.py   the EngineCore's busy loop between two ZeroMQ sockets
    core_messages.py  what crosses those sockets (msgspec)
    detokenizer.py    token ids -> text deltas, a few tokens at a time
    engine_client.py  EngineClient: what the HTTP routes need of an engine
    dp_async_llm.py, dp_router.py   data parallelism: replicas behind one front end

The HTTP server and the `myvllm` command are entrypoints/.
"""
