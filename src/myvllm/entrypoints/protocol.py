"""The OpenAI API's request bodies (validated) and response bodies (built as dicts).

Requests are parsed from the raw JSON bytes in strict mode: "max_tokens": "5" or true is an
error, not a 5 or a 1, so a client's mistake is reported instead of guessed at. Unknown
fields are ignored (OpenAI clients send fields we do not use); fields we know but do not
implement are refused when they ask for something (logprobs, n > 1, echo...).

vLLM's extra sampling fields are accepted too: top_k and ignore_eos.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from myvllm.sampling_parameters import SamplingParams


class RequestError(Exception):
    """A client's mistake: answered with OpenAI's error JSON and a 4xx status."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param


ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 413: "RequestTooLargeError",
               500: "InternalServerError", 503: "ServiceUnavailableError"}

# Every generated token is matched against every stop string (and a stop string's beginnings
# are looked for at the end of the text), so their number and length bound that work.
# OpenAI allows 4 stop strings; these limits are far above any real use.
MAX_STOP_STRINGS = 64
MAX_STOP_LENGTH = 256


def error_body(message: str, status: int, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "Error"),
                      "param": param, "code": status}}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingRequest(_Strict):
    """Fields shared by completions and chat completions. None means "the default"."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # -1 or 0: no limit (vLLM accepts both)
    seed: int | None = Field(None, ge=0)
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Known but not implemented: refused when they ask for anything.
    logprobs: Any = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    @model_validator(mode="after")
    def _refuse_unimplemented(self) -> _SamplingRequest:
        if self.n != 1:
            raise ValueError("n > 1 is not supported: send one request per completion")
        if self.logprobs not in (None, False):
            raise ValueError("logprobs are not supported")
        if self.presence_penalty or self.frequency_penalty or self.logit_bias:
            raise ValueError("presence_penalty, frequency_penalty and logit_bias are not "
                             "supported")
        stop = self.stop_strings
        if not all(stop):
            raise ValueError("stop strings must not be empty")
        if len(stop) > MAX_STOP_STRINGS:
            raise ValueError(f"{len(stop)} stop strings; at most {MAX_STOP_STRINGS} are taken")
        if any(len(s) > MAX_STOP_LENGTH for s in stop):
            raise ValueError(f"a stop string of {max(len(s) for s in stop)} characters; "
                             f"at most {MAX_STOP_LENGTH} are taken")
        return self

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """SamplingParams checks the values again and raises ValueError on a bad one."""
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if self.top_k in (None, 0) else self.top_k,
            max_tokens=default_max_tokens if self.max_tokens is None else self.max_tokens,
            ignore_eos=self.ignore_eos,
            seed=self.seed,
        )


class CompletionRequest(_SamplingRequest):
    # A string, token ids, or a list of one of those (a batch of one).
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None

    @model_validator(mode="after")
    def _one_prompt(self) -> CompletionRequest:
        if self.echo or (self.best_of or 1) > 1 or self.suffix:
            raise ValueError("echo, best_of > 1 and suffix are not supported")
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ValueError("a batch of prompts is not supported: send one request per "
                                 "prompt")
            self.prompt = prompt[0]
        if not self.prompt:
            raise ValueError("the prompt is empty")
        return self


class ContentPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: str
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer name for max_tokens
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _max_tokens(self) -> ChatCompletionRequest:
        if self.max_tokens is None:
            self.max_tokens = self.max_completion_tokens
        return self


def parse_request(model: type[_SamplingRequest], body: bytes) -> Any:
    """Validate a JSON body; every problem becomes one RequestError (status 400)."""
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        problems = []
        for err in e.errors(include_url=False):
            where = ".".join(str(p) for p in err["loc"])
            problems.append(f"{where}: {err['msg']}" if where else err["msg"])
        param = ".".join(str(p) for p in e.errors()[0]["loc"]) or None
        raise RequestError("invalid request: " + "; ".join(problems), 400, param) from None


# ---------------------------------------------------------------------------- responses
def usage(num_prompt_tokens: int, num_completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
            "total_tokens": num_prompt_tokens + num_completion_tokens}


def completion_response(request_id: str, model: str, text: str, finish_reason: str | None,
                        usage_: dict[str, int] | None, chunk: bool = False) -> dict[str, Any]:
    """A /v1/completions body; with chunk=True one server-sent event of a stream."""
    return {"id": request_id, "object": "text_completion", "created": int(time.time()),
            "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None,
                         "finish_reason": finish_reason}],
            "usage": usage_}


def chat_response(request_id: str, model: str, text: str, finish_reason: str | None,
                  usage_: dict[str, int]) -> dict[str, Any]:
    return {"id": request_id, "object": "chat.completion", "created": int(time.time()),
            "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "logprobs": None, "finish_reason": finish_reason}],
            "usage": usage_}


def chat_chunk(request_id: str, model: str, delta: dict[str, str] | None,
               finish_reason: str | None = None,
               usage_: dict[str, int] | None = None) -> dict[str, Any]:
    """One event of a streamed chat completion; delta None = the usage-only last event."""
    choices = [] if delta is None else [{"index": 0, "delta": delta, "logprobs": None,
                                         "finish_reason": finish_reason}]
    return {"id": request_id, "object": "chat.completion.chunk", "created": int(time.time()),
            "model": model, "choices": choices, "usage": usage_}
