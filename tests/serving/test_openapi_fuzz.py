"""The server fuzzed from its own OpenAPI schema (schemathesis): every route the schema
declares, with request bodies generated from the declared models, both fitting the schema and
breaking it (wrong types, missing and extra fields, out-of-range numbers). Every answer is a
non-5xx, and the server stays healthy: /health answers 200 after each request.

The server is the one test_server.py shares (conftest.py: the tiny chat model, its engine core
in a child process). The quick run sends the same 3 examples per route and mode each time (30
requests: a route without input has one; 7-9 s on a 2-core CPU, most of it hypothesis building
the requests); `-m slow` 10 new ones. (schemathesis's own pytest plugin does not run under
pytest 9, so the routes' strategies are driven by hypothesis here.)
"""

from __future__ import annotations

from typing import Any

import pytest

schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402

from test_server import fetch  # noqa: E402

REQUEST_TIMEOUT_S = 60  # an answer not there by then is a hang, and fails the test
# A generated request asks for at most this many tokens: without it a valid request runs to the
# 256-token context (seconds on a CPU), which tests the model, not the API.
MAX_TOKENS = 4
GENERATING = ("/v1/completions", "/v1/chat/completions")


def few_tokens(case: Any) -> Any:
    body = case.body
    if case.path in GENERATING and isinstance(body, dict):
        for key in ("max_tokens", "max_completion_tokens"):
            if type(body.get(key)) is int and body[key] > MAX_TOKENS:
                body[key] = MAX_TOKENS
        if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
            body["max_tokens"] = MAX_TOKENS
    return case


def check_case(case: Any, base_url: str) -> None:
    response = case.call(base_url=base_url, timeout=REQUEST_TIMEOUT_S)
    case.validate_response(response, checks=[not_a_server_error])
    status, body = fetch("GET", f"{base_url}/health")
    assert status == 200, f"after {case.method} {case.path}: /health {status} {body!r}"


def fuzz(base_url: str, max_examples: int, derandomize: bool = True) -> list[str]:
    """Every operation of the schema, max_examples requests in each mode; the labels."""
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    labels = []
    for result in schema.get_all_operations():
        operation = result.ok()  # raises if the schema is broken
        labels.append(operation.label)
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            @settings(max_examples=max_examples, deadline=None, derandomize=derandomize,
                      database=None, suppress_health_check=list(HealthCheck))
            @given(case=operation.as_strategy(generation_mode=mode).map(few_tokens))
            def run(case: Any) -> None:
                check_case(case, base_url)

            try:
                run()
            except Unsatisfiable:
                # An operation that takes no input has no request that breaks its schema.
                assert mode is GenerationMode.NEGATIVE, operation.label
    return labels


def test_fuzz_every_route_short(base_url: str) -> None:
    labels = fuzz(base_url, max_examples=3)
    for route in ("POST /v1/completions", "POST /v1/chat/completions", "POST /tokenize",
                  "POST /detokenize", "GET /health", "GET /metrics"):
        assert route in labels, labels


@pytest.mark.slow
def test_fuzz_every_route_long(base_url: str) -> None:
    fuzz(base_url, max_examples=10, derandomize=False)
