"""A conversation through the tokenizer's chat template, as the model was trained to read it:
the prompt's token ids for LLM.chat, `myvllm chat` and the server's /v1/chat/completions and
/tokenize.
"""

from __future__ import annotations

import json
from typing import Any

from myvllm.value_checks import refusal

Message = dict[str, Any]


class NoChatTemplateError(ValueError):
    """The model has no tokenizer or no chat template (and none was given)."""


def chat_prompt_ids(tokenizer: Any, messages: list[Message], *,
                    add_generation_prompt: bool = True, chat_template: str | None = None,
                    template_kwargs: dict[str, Any] | None = None,
                    tools: list[dict[str, Any]] | None = None) -> list[int]:
    """messages (one conversation of {"role", "content"} dicts) as token ids, by default ending
    with the assistant's turn opened. chat_template: a Jinja template used instead of the
    tokenizer's own. template_kwargs reach the template (e.g. enable_thinking); tools (OpenAI's
    {"type": "function", "function": {...}} dicts) too, as `tools`, for templates that show
    the model what it may call (None: no tools, as a template without them reads). An
    assistant message's tool calls may carry their arguments as JSON text (OpenAI's shape):
    the template reads them as a dict (template_messages). Tokenized
    without adding special tokens: the template writes them. A template that refuses the
    messages raises jinja2's TemplateError (or ValueError/TypeError)."""
    if tokenizer is None:
        raise NoChatTemplateError("this model has no tokenizer, so no chat template: "
                                  "pass prompts as token ids to generate()")
    if not (chat_template or getattr(tokenizer, "chat_template", None)):
        raise NoChatTemplateError("this model has no chat template")
    kwargs = dict(template_kwargs or {})
    if tools is not None:
        check_tools(tools)
        if "tools" in kwargs:
            raise refusal("chat_template_kwargs['tools']", kwargs["tools"], "none beside "
                          "tools (tools given twice: as tools and in chat_template_kwargs)")
        kwargs["tools"] = tools
    text = tokenizer.apply_chat_template(template_messages(messages), tokenize=False,
                                         add_generation_prompt=add_generation_prompt,
                                         chat_template=chat_template, **kwargs)
    return list(tokenizer.encode(text, add_special_tokens=False))


def conversations(messages: Any) -> list[list[Message]]:
    """LLM.chat's messages: one conversation (a list of message dicts) or a list of them, as a
    list of conversations; anything else is a TypeError."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise refusal("messages", messages, "a conversation (a non-empty list of {'role', "
                      "'content'} dicts) or a list of conversations", TypeError)
    batch = [messages] if isinstance(messages[0], dict) else list(messages)
    for i, conversation in enumerate(batch):
        if (not isinstance(conversation, (list, tuple)) or not conversation
                or not all(isinstance(m, dict) for m in conversation)):
            raise refusal(f"conversations[{i}]", conversation, "a non-empty list of {'role', "
                          "'content'} dicts", TypeError)
    return [list(c) for c in batch]


def template_messages(messages: list[Message]) -> list[Message]:
    """messages as chat templates read them: each tool call's arguments a dict, parsed from
    the JSON text OpenAI's shape carries (vLLM's rule: templates write them with tojson). The
    caller's dicts are not changed; arguments that are not a JSON object raise ValueError."""
    read = []
    for i, message in enumerate(messages):
        calls = message.get("tool_calls") if isinstance(message, dict) else None
        if isinstance(calls, list) and any(_text_arguments(call) for call in calls):
            message = {**message, "tool_calls": [
                _with_dict_arguments(call, f"messages[{i}].tool_calls[{j}]")
                for j, call in enumerate(calls)]}
        read.append(message)
    return read


def _text_arguments(call: Any) -> bool:
    function = call.get("function") if isinstance(call, dict) else None
    return isinstance(function, dict) and isinstance(function.get("arguments"), str)


def _with_dict_arguments(call: Any, where: str) -> Any:
    if not _text_arguments(call):
        return call
    function = call["function"]
    text = function["arguments"]
    try:
        arguments = json.loads(text or "{}")  # "" is no arguments, as the server takes it
    except ValueError:
        raise refusal(f"{where}.function.arguments", text, "a JSON object, as text or as a "
                      "dict (this text is not JSON)") from None
    if not isinstance(arguments, dict):
        raise refusal(f"{where}.function.arguments", text, "a JSON object, as text or as a "
                      "dict (this JSON is not an object)")
    return {**call, "function": {**function, "arguments": arguments}}


def check_tools(tools: Any) -> None:
    """tools as chat templates read them: a list of OpenAI's function tools, each
    {"type": "function", "function": {"name": ..., "parameters": ...}}."""
    if not isinstance(tools, (list, tuple)):
        raise refusal("tools", tools, 'a list of {"type": "function", "function": {"name": '
                      "...}} dicts, or None", TypeError)
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not (isinstance(function, dict) and isinstance(function.get("name"), str)
                and tool.get("type", "function") == "function"):
            raise refusal(f"tools[{i}]", tool, 'a function tool, {"type": "function", '
                          '"function": {"name": ..., "description": ..., "parameters": {a JSON '
                          "schema}}}", TypeError)
