"""A conversation through the tokenizer's chat template, as the model was trained to read it:
the prompt's token ids for LLM.chat, `myvllm chat` and the server's /v1/chat/completions and
/tokenize.
"""

from __future__ import annotations

from typing import Any

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
    the model what it may call (None: no tools, as a template without them reads). Tokenized
    without adding special tokens: the template writes them. A template that refuses the
    messages raises jinja2's TemplateError (or ValueError/TypeError)."""
    if tokenizer is None:
        raise NoChatTemplateError("this model has no tokenizer, so no chat template: "
                                  "pass prompts as token ids to generate()")
    if not (chat_template or getattr(tokenizer, "chat_template", None)):
        raise NoChatTemplateError("this model has no chat template")
    kwargs = dict(template_kwargs or {})
    if tools is not None:
        if "tools" in kwargs:
            raise ValueError("tools given twice: as tools and in chat_template_kwargs")
        kwargs["tools"] = tools
    text = tokenizer.apply_chat_template(messages, tokenize=False,
                                         add_generation_prompt=add_generation_prompt,
                                         chat_template=chat_template, **kwargs)
    return list(tokenizer.encode(text, add_special_tokens=False))


def conversations(messages: Any) -> list[list[Message]]:
    """LLM.chat's messages: one conversation (a list of message dicts) or a list of them, as a
    list of conversations; anything else is a TypeError."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise TypeError("messages must be a conversation (a non-empty list of "
                        "{'role', 'content'} dicts) or a list of conversations, got "
                        f"{type(messages).__name__ if messages is not None else None}"
                        f"{' (empty)' if isinstance(messages, (list, tuple)) else ''}")
    batch = [messages] if isinstance(messages[0], dict) else list(messages)
    for i, conversation in enumerate(batch):
        if (not isinstance(conversation, (list, tuple)) or not conversation
                or not all(isinstance(m, dict) for m in conversation)):
            raise TypeError(f"conversation {i} must be a non-empty list of "
                            "{'role', 'content'} dicts")
    return [list(c) for c in batch]
