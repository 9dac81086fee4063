"""The OpenAI API's response bodies, built as dicts (requests are in protocol.py)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from json.encoder import encode_basestring_ascii
from typing import Any


@dataclass
class Choice:
    """One prompt's answer, or the news of one streamed event."""

    index: int  # prompt index * n + i (completion i of the prompt), as OpenAI numbers them
    text: str
    finish_reason: str | None
    logprobs: dict[str, Any] | None = None  # entrypoints/logprobs.py's shape, if asked
    # A chat answer read as more than text (chat_output_parsing.py): its message.
    message: dict[str, Any] | None = None


def usage(num_prompt_tokens: int, num_completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
            "total_tokens": num_prompt_tokens + num_completion_tokens}


def completion_response(request_id: str, model: str, choices: list[Choice],
                        usage_: dict[str, int] | None) -> dict[str, Any]:
    """A /v1/completions body, or one server-sent event of its stream."""
    return {"id": request_id, "object": "text_completion", "created": int(time.time()),
            "model": model,
            "choices": [{"index": c.index, "text": c.text, "logprobs": c.logprobs,
                         "finish_reason": c.finish_reason} for c in choices],
            "usage": usage_}


class CompletionEvents:
    """The server-sent events of one streamed completion's choices, built from parts encoded
    once per request: per event only the time, the choice's index, text, logprobs and finish
    reason are encoded. Each event's bytes are those of
    sse(completion_response(request_id, model, [choice], None)), json.dumps's spacing and
    escapes included (a str is encoded by the function json.dumps uses for it)."""

    def __init__(self, request_id: str, model: str) -> None:
        self._head = (f'data: {{"id": {json.dumps(request_id)}, "object": "text_completion", '
                      '"created": ')
        self._model = f', "model": {json.dumps(model)}, "choices": [{{"index": '

    def event(self, choice: Choice, logprobs_json: str | None = None) -> str:
        """logprobs_json: choice.logprobs already encoded (a large part is encoded in pieces,
        json_chunks.py, in its own spacing)."""
        logprobs = (logprobs_json if logprobs_json is not None
                    else "null" if choice.logprobs is None else json.dumps(choice.logprobs))
        reason = "null" if choice.finish_reason is None else json.dumps(choice.finish_reason)
        return (f'{self._head}{int(time.time())}{self._model}{choice.index}, "text": '
                f'{encode_basestring_ascii(choice.text)}, "logprobs": {logprobs}, '
                f'"finish_reason": {reason}}}], "usage": null}}\n\n')


def chat_response(request_id: str, model: str, choices: list[Choice],
                  usage_: dict[str, int]) -> dict[str, Any]:
    return {"id": request_id, "object": "chat.completion", "created": int(time.time()),
            "model": model,
            "choices": [{"index": c.index,
                         "message": c.message or {"role": "assistant", "content": c.text},
                         "logprobs": c.logprobs, "finish_reason": c.finish_reason}
                        for c in choices],
            "usage": usage_}


def chat_chunk(request_id: str, model: str, delta: dict[str, Any] | None,
               finish_reason: str | None = None,
               usage_: dict[str, int] | None = None,
               logprobs: dict[str, Any] | None = None, index: int = 0) -> dict[str, Any]:
    """One event of a streamed chat completion, for choice `index` (completion `index` of
    n); delta None = the usage-only last event."""
    choices = [] if delta is None else [{"index": index, "delta": delta, "logprobs": logprobs,
                                         "finish_reason": finish_reason}]
    return {"id": request_id, "object": "chat.completion.chunk", "created": int(time.time()),
            "model": model, "choices": choices, "usage": usage_}


def model_card(model: str, created: int, max_model_length: int) -> dict[str, Any]:
    """One entry of GET /v1/models, and the body of GET /v1/models/{id}."""
    return {"id": model, "object": "model", "created": created, "owned_by": "myvllm",
            "max_model_len": max_model_length}
