"""The server that test_server.py and test_server_api.py share: built once per session, as
starting an engine core takes seconds (tens on a busy 2-core machine)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest


@pytest.fixture(scope="session")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The tiny chat model served on a free port, its engine core in a child process as
    under `myvllm serve`; SERVED["llm"] in test_server.py is its AsyncLLM."""
    from test_server import MAX_MODEL_LENGTH, MODEL, SERVED, free_socket, tiny_chat_checkpoint

    from myvllm import Config
    from myvllm.engine.async_llm import AsyncLLM
    from myvllm.entrypoints.openai_server import make_server

    path = tiny_chat_checkpoint(tmp_path_factory.mktemp("tiny_chat"))
    # A small KV cache: 16 concurrent requests fit, and a leaked block shows in the usage.
    llm = AsyncLLM(Config(model=str(path), num_kvcache_blocks=128,
                          max_model_length=MAX_MODEL_LENGTH, max_num_sequences=32))
    SERVED["llm"] = llm
    sock = free_socket()
    server = make_server(llm, MODEL, "127.0.0.1", sock.getsockname()[1], log_level="warning")
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:  # uvicorn sets it once the socket accepts connections
        assert thread.is_alive(), "the server thread died while starting"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    thread.join(30)
    llm.shutdown()
    sock.close()
