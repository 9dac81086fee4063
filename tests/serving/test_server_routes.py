"""vLLM's routes and serve options, in process (FastAPI's TestClient over build_app; no engine
runs, the routes tested answer without one): GET /version, /ping, the API key, and the
chat template given to the server."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

openai = pytest.importorskip("openai")

from fastapi.testclient import TestClient  # noqa: E402

from helpers_models import tiny_checkpoint  # noqa: E402
from myvllm.entrypoints.metrics import PrometheusStatLogger  # noqa: E402
from myvllm.entrypoints.openai_server import (  # noqa: E402
    build_app, installed_version, myvllm_version)

KEY = "sk-test-key"
TEMPLATE = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}> "
OPEN_ROUTES = ["/health", "/ping", "/metrics", "/version"]


class IdleEngine:
    """What the routes tested read of an EngineClient; nothing is ever generated."""

    def __init__(self) -> None:
        from transformers import AutoTokenizer

        # The byte-level tokenizer (token i = byte i), without a chat template of its own.
        self.tokenizer = AutoTokenizer.from_pretrained(str(tiny_checkpoint("qwen3")))
        self.max_model_length = 256
        self.vocab_size = 256
        self.is_running = True

    def start(self) -> None:  # the app's lifespan starts the engine's output loop
        pass


def client_of(**app_kwargs: Any) -> TestClient:
    app = build_app(IdleEngine(), "tiny", PrometheusStatLogger("tiny"),  # type: ignore[arg-type]
                    **app_kwargs)
    return TestClient(app)


@pytest.fixture(scope="module")
def keyed() -> Iterator[TestClient]:
    with client_of(api_key=KEY) as client:
        yield client


def test_version_and_ping() -> None:
    client = client_of()
    assert client.get("/version").json() == {"version": myvllm_version}
    assert myvllm_version  # the installed package's version (pyproject.toml)
    assert client.get("/ping").status_code == 200
    assert client.post("/ping").status_code == 200


def test_version_without_installed_metadata(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run from source (src/ on PYTHONPATH, nothing installed, as on the GPU machine) the
    server still starts: /version says so instead of the import failing."""
    import importlib.metadata

    def not_installed(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    assert installed_version() == "unknown (run from source)"


def test_without_a_key_every_route_is_open() -> None:
    client = client_of()
    assert client.get("/v1/models").status_code == 200


def test_the_api_key_guards_every_route_but_the_probes(keyed: TestClient) -> None:
    for path in OPEN_ROUTES:
        assert keyed.get(path).status_code == 200, path
    for method, path in [("GET", "/v1/models"), ("GET", "/v1/models/tiny"),
                         ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                         ("POST", "/tokenize"), ("POST", "/detokenize"),
                         ("GET", "/openapi.json"), ("GET", "/no/such/route")]:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            answer = keyed.request(method, path, headers=headers, json={})
            assert answer.status_code == 401, (method, path, headers)
            error = answer.json()["error"]
            assert error["code"] == 401 and error["type"] == "AuthenticationError"
            assert "Authorization: Bearer" in error["message"]
    good = {"Authorization": f"Bearer {KEY}"}
    assert keyed.get("/v1/models", headers=good).status_code == 200
    # Past the key, a request is judged as without one (here: an empty body is a 400).
    assert keyed.post("/v1/completions", headers=good, json={}).status_code == 400


def test_the_openai_client_with_and_without_the_key(keyed: TestClient) -> None:
    def client(api_key: str) -> Any:
        return openai.OpenAI(base_url="http://testserver/v1", api_key=api_key,
                             http_client=keyed, max_retries=0)

    assert [m.id for m in client(KEY).models.list()] == ["tiny"]
    for wrong in ("sk-wrong", "unused"):
        with pytest.raises(openai.AuthenticationError, match="Authorization: Bearer"):
            client(wrong).models.list()
        with pytest.raises(openai.AuthenticationError):
            client(wrong).chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}])


def test_the_servers_chat_template_replaces_the_tokenizers() -> None:
    body = {"messages": [{"role": "user", "content": "Hello"}]}
    answer = client_of().post("/tokenize", json=body)
    assert answer.status_code == 400 and "no chat template" in answer.json()["error"]["message"]
    answer = client_of(chat_template=TEMPLATE).post("/tokenize", json=body)
    assert answer.status_code == 200
    assert answer.json()["tokens"] == list("[user] Hello\n> ".encode())
