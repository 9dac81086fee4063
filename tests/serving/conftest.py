"""The server that test_server.py and test_server_api.py share: built once per session, as
starting an engine core takes seconds (tens on a busy 2-core machine)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(scope="session")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The tiny chat model served on a free port, its engine core in a child process as
    under `myvllm serve`; SERVED["llm"] in test_server.py is its AsyncLLM."""
    from test_server import MAX_MODEL_LENGTH, MODEL, SERVED, served_in_thread, tiny_chat_checkpoint

    from myvllm import Config
    from myvllm.serving.async_llm import AsyncLLM

    path = tiny_chat_checkpoint(tmp_path_factory.mktemp("tiny_chat"))
    # A small KV cache: 16 concurrent requests fit, and a leaked block shows in the usage.
    llm = AsyncLLM(Config(model=str(path), num_kvcache_blocks=128,
                          max_model_length=MAX_MODEL_LENGTH, max_num_sequences=32))
    SERVED["llm"] = llm
    with served_in_thread(llm, MODEL, log_level="warning") as url:
        yield url
