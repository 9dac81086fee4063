"""`myvllm serve --api-key KEY --chat-template FILE` end to end: a server of its own on the tiny
chat model (test_server.py's), its engine core in a child process, and the official openai
client with and without the key (tests/serving/test_server_routes.py covers every route in
process)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

openai = pytest.importorskip("openai")

from test_server import MAX_MODEL_LENGTH, MODEL, served_in_thread, tiny_chat_checkpoint  # noqa: E402,E501

from myvllm import Config  # noqa: E402
from myvllm.entrypoints.cli import read_chat_template  # noqa: E402

KEY = "sk-test-key"
TEMPLATE = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}> "


@pytest.fixture(scope="module")
def keyed_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from myvllm.serving.async_llm import AsyncLLM

    folder = tmp_path_factory.mktemp("keyed")
    template = folder / "chat.jinja"
    template.write_text(TEMPLATE)
    path = tiny_chat_checkpoint(folder / "model")
    llm = AsyncLLM(Config(model=str(path), num_kvcache_blocks=64,
                          max_model_length=MAX_MODEL_LENGTH, max_num_sequences=4))
    with served_in_thread(llm, MODEL, log_level="warning", api_key=KEY,
                          chat_template=read_chat_template(str(template))) as url:
        yield url


def client(url: str, api_key: str) -> Any:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0)


def test_the_openai_client_needs_the_key(keyed_url: str) -> None:
    messages = [{"role": "user", "content": "Hello"}]
    answer = client(keyed_url, KEY).chat.completions.create(
        model=MODEL, messages=messages, max_tokens=3, temperature=0,
        extra_body={"ignore_eos": True})
    assert answer.usage.completion_tokens == 3
    # The server's template, not the tokenizer's: the byte tokenizer counts its bytes.
    assert answer.usage.prompt_tokens == len("[user] Hello\n> ".encode())
    # The client always sends a key (it refuses to start without one): a wrong one.
    for wrong in ("sk-wrong", "unused"):
        with pytest.raises(openai.AuthenticationError, match="Authorization: Bearer"):
            client(keyed_url, wrong).chat.completions.create(model=MODEL, messages=messages,
                                                             max_tokens=3)
        with pytest.raises(openai.AuthenticationError):
            client(keyed_url, wrong).completions.create(model=MODEL, prompt="Hi",
                                                        max_tokens=3)


def test_no_authorization_header_is_a_401(keyed_url: str) -> None:
    import json
    import urllib.error
    import urllib.request

    request = urllib.request.Request(f"{keyed_url}/v1/models")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=30)
    assert refused.value.code == 401
    assert json.loads(refused.value.read())["error"]["type"] == "AuthenticationError"


def test_the_probes_stay_open(keyed_url: str) -> None:
    import urllib.request

    for path in ("/health", "/ping", "/metrics", "/version"):
        with urllib.request.urlopen(f"{keyed_url}{path}", timeout=30) as answer:
            assert answer.status == 200, path


def test_read_chat_template_reads_the_file(tmp_path: Path) -> None:
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    assert read_chat_template(str(tmp_path / "t.jinja")) == TEMPLATE
    assert read_chat_template(None) is None
