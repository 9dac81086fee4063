"""CompletionEvents (entrypoints/responses.py) builds a streamed completion's events from
parts encoded once per request: each event must be byte for byte what
sse(completion_response(...)) makes of the same choice."""

from __future__ import annotations

import pytest

from myvllm.entrypoints import responses
from myvllm.entrypoints.responses import Choice, CompletionEvents, completion_response
from myvllm.entrypoints.serving_completion import sse

CHOICES = [
    Choice(0, "", None),
    Choice(3, " plain text", None),
    Choice(1, 'quotes " and \\ backslash, a tab\t, a newline\n', "length"),
    Choice(0, "é, € and 😀 (escaped as json.dumps does)", "stop"),
    Choice(2, "with logprobs", None, {"tokens": ["a", "é"], "token_logprobs": [-0.5, None],
                                      "top_logprobs": [{"a": -0.5}, None],
                                      "text_offset": [0, 1]}),
    Choice(0, "", "abort", {"content": [{"token": "x", "logprob": -1.25, "bytes": [120]}]}),
]


@pytest.mark.parametrize("choice", CHOICES)
def test_an_event_is_the_json_of_its_response(monkeypatch: pytest.MonkeyPatch,
                                              choice: Choice) -> None:
    monkeypatch.setattr(responses.time, "time", lambda: 1765000000.75)
    for request_id, model in (("cmpl-abc123", "fake"), ('cmpl-"odd"', "Qwen/Qwen3-0.6B é")):
        expected = sse(completion_response(request_id, model, [choice], None))
        assert CompletionEvents(request_id, model).event(choice) == expected
