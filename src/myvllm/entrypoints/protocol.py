"""The OpenAI API's request bodies, validated from raw JSON bytes.

Strict: "max_tokens": "5" or true is an error, not a 5 or a 1, so a client's mistake is
reported instead of guessed at. Every field either works or is refused with a 400 that names
it, so that no answer looks as if it honoured a field it ignored:

- fields that work: the sampling fields below (OpenAI's, with its presence_penalty,
  frequency_penalty and logit_bias, and vLLM's extras top_k, min_p, repetition_penalty,
  min_tokens, stop_token_ids and ignore_eos), stop strings, streaming
  (stream_options.include_usage), `n` (completions per prompt), prompt batches, `echo` and
  `logprobs` in /v1/completions, `logprobs` and `top_logprobs` in chat; structured outputs:
  OpenAI's `response_format` (json_object, json_schema) and vLLM's `structured_outputs` and
  older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` (one of them a
  request); tool calling in chat (`tools`, `tool_choice`, `parallel_tool_calls`, and the
  messages that carry calls and their results: `tool_calls`, `tool_call_id`), checked here as
  vLLM checks them (tool_choice without tools is a 400; tools without tool_choice mean
  "auto"; "required" with no tools means "none");
- `user` is taken and ignored: an end-user id for the provider's abuse monitoring, with no
  effect on the answer;
- fields of OpenAI's (or vLLM's) API that are not implemented yet (NOT_YET) are taken at the
  value that asks for nothing (null, or "best_of": 1) and refused otherwise; `suffix` only
  at null;
- any other field is refused as unknown, with the list of the fields allowed (OpenAI's own
  API does the same).

Response bodies are in responses.py.
"""

from __future__ import annotations

import json
import typing
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import (BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError,
                      model_validator)

from myvllm.entrypoints.tool_parsers.tool_choice import named_function_schema, required_schema
from myvllm.sampling_parameters import (MAX_LOGPROBS, MAX_N, SamplingParams,
                                          StructuredOutputsParams)
from myvllm.value_checks import refusal


class RequestError(Exception):
    """A client's mistake: answered with OpenAI's error JSON and a 4xx status."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param


ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
               413: "RequestTooLargeError",
               500: "InternalServerError", 503: "ServiceUnavailableError"}

# Every generated token is matched against every stop string (and a stop string's beginnings
# are looked for at the end of the text), so their number and length bound that work.
# OpenAI allows 4 stop strings; these limits are far above any real use.
MAX_STOP_STRINGS = 64
MAX_STOP_LENGTH = 256

# Known fields not implemented yet: field -> (does this value ask for nothing?, the values
# allowed). null is always allowed. A field missing from a request body's model is simply
# unknown there.
NOT_YET: dict[str, tuple[Callable[[Any], bool], str]] = {
    # The best n of best_of completions (by their logprob): not implemented; n is.
    "best_of": (lambda v: v == 1, "1 or null"),
    # Text after the completion (insertion): refused at any value but null, "" too.
    "suffix": (lambda v: False, "null"),
}


def error_body(message: str, status: int, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "Error"),
                      "param": param, "code": status}}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)

    def unsupported(self) -> list[str]:
        """The NOT_YET fields of this model that ask for something, as "name (allowed: ...)"."""
        refused = []
        for name in type(self).model_fields:
            value = getattr(self, name)
            if name in NOT_YET and value is not None and not NOT_YET[name][0](value):
                refused.append(f"{name} (allowed: {NOT_YET[name][1]})")
        return refused


RequestBody = _Strict  # the base of every request body model


class StreamOptions(_Strict):
    include_usage: bool = False


class JsonSchemaFormat(_Strict):
    """response_format.json_schema: OpenAI's wrapper around the schema."""

    name: str
    description: str | None = None
    # "schema" would shadow a BaseModel attribute, hence the alias.
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None  # the output always follows the schema here


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_iff_json_schema(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError('response_format: "json_schema" goes with type "json_schema", '
                             "and only with it")
        return self


class StructuredOutputs(_Strict):
    """vLLM's structured_outputs field: StructuredOutputsParams' fields (one constraint)."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False


class _SamplingRequest(_Strict):
    """Fields shared by completions and chat completions. None means "the default"."""

    model: str | None = None
    # >= 1, checked as SamplingParams checks it (serving_completion.check_prompt): the
    # library's message, not pydantic's.
    max_tokens: int | None = None
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # -1 or 0: no limit (vLLM accepts both)
    seed: int | None = Field(None, ge=0)
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # taken and ignored (see the module docstring)
    n: int | None = Field(None, ge=1, le=MAX_N)  # completions of each prompt
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    min_p: float | None = Field(None, ge=0, le=1)
    # OpenAI's shape: token ids as strings (JSON keys), each bias in [-100, 100].
    logit_bias: dict[str, float] | None = None
    min_tokens: int | None = Field(None, ge=0)
    stop_token_ids: list[int] | None = None
    # Structured outputs (at most one of these): OpenAI's, vLLM's, vLLM's older names.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @model_validator(mode="after")
    def _check_stop(self) -> _SamplingRequest:
        stop = self.stop_strings
        if not all(stop):
            raise refusal(f"stop[{stop.index('')}]", "", "a string of at least 1 character")
        if len(stop) > MAX_STOP_STRINGS:
            raise refusal("len(stop)", len(stop), f"at most {MAX_STOP_STRINGS} stop strings")
        if any(len(s) > MAX_STOP_LENGTH for s in stop):
            longest = max(range(len(stop)), key=lambda i: len(stop[i]))
            raise refusal(f"len(stop[{longest}])", len(stop[longest]),
                          f"at most {MAX_STOP_LENGTH} characters")
        return self

    @model_validator(mode="after")
    def _check_logit_bias(self) -> _SamplingRequest:
        for key, bias in (self.logit_bias or {}).items():
            if not (key.isascii() and key.isdigit()):
                raise refusal("logit_bias key", key, "a token id (a string of digits)")
            if not -100 <= bias <= 100:
                raise refusal(f"logit_bias[{key!r}]", bias, "a number in [-100, 100]")
        return self

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        """SamplingParams checks the values again and raises ValueError on a bad one."""
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if self.top_k in (None, 0) else self.top_k,
            max_tokens=max_tokens,
            ignore_eos=self.ignore_eos,
            seed=self.seed,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=(1.0 if self.repetition_penalty is None
                                else self.repetition_penalty),
            min_p=self.min_p or 0.0,
            logit_bias=({int(token): bias for token, bias in self.logit_bias.items()}
                        if self.logit_bias else None),
            min_tokens=self.min_tokens or 0,
            stop_token_ids=self.stop_token_ids or None,
            n=self.num_completions,
            structured_outputs=self.structured_outputs_params(),
            logprobs=self.logprob_params().get("logprobs"),
            prompt_logprobs=self.logprob_params().get("prompt_logprobs"),
        )

    @property
    def num_completions(self) -> int:
        """n: the choices each prompt gets."""
        return 1 if self.n is None else self.n

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The one constraint asked for, if any (ValueError for two, or a bad one)."""
        asked: dict[str, StructuredOutputsParams] = {}
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            asked["response_format"] = StructuredOutputsParams(json_object=True)
        elif rf is not None and rf.json_schema is not None:
            asked["response_format"] = StructuredOutputsParams(json=rf.json_schema.json_schema)
        so = self.structured_outputs
        if so is not None:
            asked["structured_outputs"] = StructuredOutputsParams(
                json=so.json_, regex=so.regex, choice=so.choice, grammar=so.grammar,
                json_object=so.json_object, disable_any_whitespace=so.disable_any_whitespace)
        for name, kind in (("guided_json", "json"), ("guided_regex", "regex"),
                           ("guided_choice", "choice"), ("guided_grammar", "grammar")):
            value = getattr(self, name)
            if value is not None:
                asked[name] = StructuredOutputsParams(**{kind: value})
        if len(asked) > 1:
            raise ValueError(f"at most one structured output constraint per request, got "
                             f"{', '.join(asked)}")
        return next(iter(asked.values()), None)

    def logprob_params(self) -> dict[str, int | None]:
        """SamplingParams' logprobs and prompt_logprobs, as each endpoint asks for them."""
        return {}


Prompt = str | list[int]


class CompletionRequest(_SamplingRequest):
    # A string or token ids, or a batch: a list of strings or of token-id lists.
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool | None = None  # the answer's text starts with the prompt's
    # The sampled token's logprob and the k most likely tokens' (with echo, the prompt's too).
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # Not implemented yet (NOT_YET).
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None

    def logprob_params(self) -> dict[str, int | None]:
        return {"logprobs": self.logprobs,
                "prompt_logprobs": self.logprobs if self.echo else None}

    @model_validator(mode="after")
    def _not_empty(self) -> CompletionRequest:
        if not self.prompt:
            raise refusal("prompt", self.prompt, "a text or token ids, not empty")
        if self.is_batch:
            empty = [i for i, prompt in enumerate(self.prompts) if not prompt]
            if empty:
                raise refusal(f"prompt[{empty[0]}]", self.prompts[empty[0]],
                              "a text or token ids, not empty")
        return self

    @property
    def is_batch(self) -> bool:
        prompt = self.prompt
        return isinstance(prompt, list) and isinstance(prompt[0], (str, list))

    @property
    def prompts(self) -> list[Prompt]:
        """The prompts in order: one, or each of a batch."""
        if self.is_batch:
            return list(self.prompt)  # type: ignore[arg-type]  # a list of prompts here
        return [self.prompt]  # type: ignore[list-item]  # one prompt here


class ContentPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str  # a JSON object, as text (OpenAI's shape)

    @model_validator(mode="after")
    def _arguments_are_json(self) -> FunctionCall:
        try:
            arguments = json.loads(self.arguments or "{}")
        except ValueError:
            raise ValueError(f"the arguments of a call of {self.name!r} are not JSON: "
                             f"{self.arguments[:80]!r}") from None
        if not isinstance(arguments, dict):
            raise ValueError(f"the arguments of a call of {self.name!r} are not a JSON object")
        return self


class ToolCall(_Strict):
    """A call an assistant message made (the answer's message.tool_calls, sent back)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None  # given to the chat template, which may show it
    tool_calls: list[ToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool's answer: the call it answers
    reasoning_content: str | None = None  # an assistant turn's thinking, as answered

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def for_template(self) -> dict[str, Any]:
        """The message as a dict for chat_prompt_ids, which gives the template each call's
        arguments as a dict (utils/chat_template.py: one reading for the server and LLM.chat)."""
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [
                {"id": call.id, "type": call.type,
                 "function": {"name": call.function.name,
                              "arguments": call.function.arguments}}
                for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.reasoning_content is not None:
            message["reasoning_content"] = self.reasoning_content
        return message


class FunctionDefinition(_Strict):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments
    strict: bool | None = None  # taken: a forced call always follows the schema here


class ChatCompletionToolsParam(_Strict):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class ChatCompletionNamedToolChoiceParam(_Strict):
    """tool_choice naming the function to call."""

    type: Literal["function"] = "function"
    function: NamedFunction


class _ChatPrompt(_Strict):
    """What makes a chat prompt: the messages and how the template renders them."""

    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True  # end with the assistant's turn opened (vLLM's field)
    chat_template_kwargs: dict[str, Any] | None = None


# tool_choice: a mode, or an object naming the function; told apart by the value's type, so
# that a mistake is reported against the one it meant ("tool_choice.mode: Input should be
# 'none', 'auto' or 'required'").
ToolChoice = Annotated[
    Annotated[Literal["none", "auto", "required"], Tag("mode")]
    | Annotated[ChatCompletionNamedToolChoiceParam, Tag("named")],
    Discriminator(lambda v: "named" if isinstance(v, (dict, BaseModel)) else "mode")]


class ChatCompletionRequest(_SamplingRequest, _ChatPrompt):
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens
    logprobs: bool | None = None  # each answer token's logprob
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # and its k best's
    # Tool calling (entrypoints/tool_parsers/): the tools the model may call, and whether it
    # must (required), must call one (named), may (auto) or must not (none).
    tools: list[ChatCompletionToolsParam] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None  # false: one call at most

    @model_validator(mode="after")
    def _max_tokens(self) -> ChatCompletionRequest:
        if self.max_completion_tokens is not None:
            # The newer name wins (as in vLLM), and is checked as max_tokens then is.
            self.max_tokens = self.max_completion_tokens
        if self.top_logprobs and not self.logprobs:
            # OpenAI's and vLLM's rule: top_logprobs alone would be silently ignored.
            raise refusal("top_logprobs", self.top_logprobs, "only with logprobs: true")
        return self

    @model_validator(mode="after")
    def _check_tool_usage(self) -> ChatCompletionRequest:
        """vLLM's rules: tools without tool_choice mean "auto"; tool_choice needs tools;
        "required" with no tools is "none"; a named function must be one of the tools."""
        if self.tool_choice is None and self.tools:
            self.tool_choice = "auto"
        if self.tool_choice is None or self.tool_choice == "none":
            return self
        if self.tools is None:
            raise ValueError("When using `tool_choice`, `tools` must be set.")
        if self.tool_choice == "required" and not self.tools:
            self.tool_choice = "none"
            return self
        if isinstance(self.tool_choice, ChatCompletionNamedToolChoiceParam):
            name = self.tool_choice.function.name
            names = [tool.function.name for tool in self.tools]
            if name not in names:
                raise ValueError(f"tool_choice names the function {name!r}, which is not one "
                                 f"of the tools (allowed: {', '.join(names) or 'none'})")
        return self

    @property
    def tool_mode(self) -> str | None:
        """How the answer is read: None (no tools: as text), "auto", "required", or
        "named" (tool_choice names the function)."""
        if self.tool_choice is None or self.tool_choice == "none" or not self.tools:
            return None
        if isinstance(self.tool_choice, ChatCompletionNamedToolChoiceParam):
            return "named"
        return self.tool_choice

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools the chat template shows the model (none under tool_choice "none")."""
        if self.tool_mode is None or self.tools is None:
            return None
        return [tool.model_dump(exclude_none=True) for tool in self.tools]

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """As every request's, plus the schema of a forced call (tool_choice "required" or
        a named function), which takes no other constraint beside it."""
        asked = super().structured_outputs_params()
        schema = self.forced_call_schema()
        if schema is None:
            return asked
        if asked is not None:
            raise ValueError(f"tool_choice {self.tool_mode} constrains the answer to a call, "
                             "so it takes no other structured output constraint")
        return StructuredOutputsParams(json=schema, disable_any_whitespace=True)

    def forced_call_schema(self) -> dict[str, Any] | None:
        tools = self.template_tools() or []
        if isinstance(self.tool_choice, ChatCompletionNamedToolChoiceParam) and tools:
            return named_function_schema(tools, self.tool_choice.function.name)
        if self.tool_mode == "required":
            return required_schema(tools, self.parallel_tool_calls is not False)
        return None

    def logprob_params(self) -> dict[str, int | None]:
        return {"logprobs": (self.top_logprobs or 0) if self.logprobs else None}

    def unsupported(self) -> list[str]:
        refused = super().unsupported()
        for i, message in enumerate(self.messages):
            refused += [f"messages[{i}].{what}" for what in message.unsupported()]
        return refused


class TokenizeCompletionRequest(_Strict):
    """POST /tokenize with a prompt (vLLM's shape)."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True  # as /v1/completions tokenizes a prompt


class TokenizeChatRequest(_ChatPrompt):
    """POST /tokenize with messages: the prompt /v1/chat/completions would run (with tools:
    as the template shows them to the model, vLLM's field)."""

    model: str | None = None
    tools: list[ChatCompletionToolsParam] | None = None

    def template_tools(self) -> list[dict[str, Any]] | None:
        return [tool.model_dump(exclude_none=True) for tool in self.tools] if self.tools else None


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


def parse_request(model: type[_Strict], body: bytes) -> Any:
    """Validate a JSON body; every problem becomes one RequestError (status 400)."""
    try:
        request = model.model_validate_json(body)
    except ValidationError as e:
        problems = []
        errors = e.errors(include_url=False)
        for err in errors:
            where = ".".join(str(p) for p in err["loc"])
            if err["type"] == "extra_forbidden":
                fields = ", ".join(_allowed_fields(model, err["loc"]))
                problems.append(f"{where}: unknown field (allowed: {fields})")
            else:
                problems.append(f"{where}: {err['msg']}" if where else err["msg"])
        param = ".".join(str(p) for p in errors[0]["loc"]) or None
        raise RequestError("invalid request: " + "; ".join(problems), 400, param) from None
    refused = request.unsupported()
    if refused:
        raise RequestError(f"not supported yet: {'; '.join(refused)}", 400,
                           refused[0].split(" ")[0])
    return request


def parse_tokenize_request(body: bytes) -> TokenizeCompletionRequest | TokenizeChatRequest:
    """vLLM's /tokenize takes either shape; "messages" says which."""
    try:
        is_chat = "messages" in json.loads(body)
    except (ValueError, TypeError):
        is_chat = False  # not a JSON object: the prompt model reports what is wrong
    model = TokenizeChatRequest if is_chat else TokenizeCompletionRequest
    request: TokenizeCompletionRequest | TokenizeChatRequest = parse_request(model, body)
    return request


def _allowed_fields(model: type[BaseModel], loc: tuple[int | str, ...]) -> list[str]:
    """The fields of the (nested) model in which loc, an unknown field's path, ends; a field
    not implemented yet with the only values it takes ("suffix (only null)")."""
    candidates = [model]  # the models a step may be in: several under a union
    for step in loc[:-1]:
        if not isinstance(step, str):
            continue  # a list's index
        named = [m for m in candidates if m.__name__ == step]  # a union's member, by name
        if named:
            candidates = named
            continue
        fields = [m.model_fields[step] for m in candidates if step in m.model_fields]
        if fields:
            candidates = _models_in(fields[0].annotation) or candidates
    model = candidates[0]
    return [f"{name} (only {NOT_YET[name][1]})" if name in NOT_YET else name
            for name in sorted(model.model_fields)]


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The models an annotation holds: itself, or inside list[...] and unions."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]
