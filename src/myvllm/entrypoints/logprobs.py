"""OpenAI's two shapes of logprobs, built from the engine's LogprobsLists.

/v1/completions (`logprobs: k`), with `echo` the prompt's tokens first (the first of them
has no logprob: null):

    {"tokens": ["Hi", "!"], "token_logprobs": [-0.3, -1.2],
     "top_logprobs": [{"Hi": -0.3, "Hey": -1.9}, {"!": -1.2, ",": -0.8}],  # k best + the token
     "text_offset": [0, 2]}

/v1/chat/completions (`logprobs: true`, `top_logprobs: k`):

    {"content": [{"token": "Hi", "logprob": -0.3, "bytes": [72, 105],
                  "top_logprobs": [{"token": "Hi", "logprob": -0.3, "bytes": [72, 105]}, ...]}]}

Tokens are named by their own text (detokenizer.token_texts, each decoded once: TokenTexts
caches them); text_offset counts those texts'
lengths from the start of the choice's text, on across a stream's events (vLLM's way). JSON
has no -inf: a logprob below -9999 is sent as -9999.0, as vLLM does.
"""

from __future__ import annotations

from typing import Any

from myvllm.sample.extras import LogprobsLists
from myvllm.serving.detokenizer import token_texts

MIN_LOGPROB = -9999.0


def _finite(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


class TokenTexts:
    """Each token's own text, decoded by the tokenizer once per token id and kept (at most
    one entry per id of the vocabulary): a token decoded alone has always the same text, and
    decoding them one by one cost about 17 microseconds a token, most of the time spent on an
    answer with echo and 20 logprobs (21 tokens named per prompt token)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token_ids: list[int]) -> list[str]:
        texts = self._texts
        new = [t for t in dict.fromkeys(token_ids) if t not in texts]
        if new:  # (threads may race here: both decode, both store the same text)
            texts.update(zip(new, token_texts(self.tokenizer, new)))
        return [texts[t] for t in token_ids]


class CompletionLogprobs:
    """One choice's completions `logprobs`, output by output: each call gives the part of
    that output's tokens (a stream's event), text_offset going on from the last part."""

    def __init__(self, texts: TokenTexts) -> None:
        self.texts = texts
        self.offset = 0

    def part(self, token_ids: list[int], lists: LogprobsLists | None,
             first_has_none: bool = False) -> dict[str, list[Any]]:
        """The entries of token_ids; lists covers them all, or all but the first
        (first_has_none: a prompt's first token, which nothing predicts)."""
        part: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                      "text_offset": []}
        if not token_ids or lists is None:
            return part
        alternatives = [i for row in lists.top_token_ids for i in row]
        texts = self.texts(token_ids + alternatives)
        own, others = texts[:len(token_ids)], iter(texts[len(token_ids):])
        if first_has_none:
            self._add(part, own[0], None, None)
            own = own[1:]
        for text, logprob, top in zip(own, lists.logprobs, lists.top_logprobs, strict=True):
            # The k best, then the token itself unless it is one of them (vLLM: k or k + 1).
            entry = {next(others): _finite(lp) for lp in top}
            entry.setdefault(text, _finite(logprob))
            self._add(part, text, _finite(logprob), entry)
        return part

    def _add(self, part: dict[str, list[Any]], text: str, logprob: float | None,
             top: dict[str, float] | None) -> None:
        part["tokens"].append(text)
        part["token_logprobs"].append(logprob)
        part["top_logprobs"].append(top)
        part["text_offset"].append(self.offset)
        self.offset += len(text)


def merge_parts(parts: list[dict[str, list[Any]]]) -> dict[str, list[Any]]:
    """One non-streamed answer's logprobs: its outputs' parts end to end."""
    merged: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                    "text_offset": []}
    for part in parts:
        for key, values in part.items():
            merged[key] += values
    return merged


def chat_logprobs(token_texts: TokenTexts, token_ids: list[int], lists: LogprobsLists
                  ) -> list[dict[str, Any]]:
    """The chat `logprobs.content` entries of token_ids: each its own and its k best."""
    alternatives = [i for row in lists.top_token_ids for i in row]
    texts = token_texts(token_ids + alternatives)
    others = iter(texts[len(token_ids):])
    return [{**_chat_entry(text, logprob),
             "top_logprobs": [_chat_entry(next(others), lp) for lp in top]}
            for text, logprob, top in zip(texts[:len(token_ids)], lists.logprobs,
                                          lists.top_logprobs, strict=True)]


def _chat_entry(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode())}


class ChoiceLogprobs:
    """One choice's logprobs in its endpoint's shape, from its outputs one by one: None
    throughout when the request did not ask; with echo (completions), the prompt's
    entries lead the first part."""

    def __init__(self, texts: TokenTexts, asked: bool, chat: bool,
                 echo_prompt_ids: list[int] | None = None) -> None:
        self.texts = texts
        self.asked = asked
        self.chat = chat
        self.echo_prompt_ids = echo_prompt_ids
        self.completion = CompletionLogprobs(texts)

    def part(self, token_ids: list[int], lists: LogprobsLists | None,
             prompt_lists: LogprobsLists | None) -> dict[str, Any] | None:
        """The part of one output (token_ids and their lists; prompt_lists in the first)."""
        if not self.asked:
            return None
        if self.chat:
            return {"content": [] if lists is None
                    else chat_logprobs(self.texts, token_ids, lists)}
        parts = []
        if self.echo_prompt_ids is not None and prompt_lists is not None:
            parts.append(self.completion.part(self.echo_prompt_ids, prompt_lists,
                                              first_has_none=True))
            self.echo_prompt_ids = None
        parts.append(self.completion.part(token_ids, lists))
        return merge_parts(parts)

    def merge(self, parts: list[dict[str, Any] | None]) -> dict[str, Any] | None:
        """A non-streamed answer's logprobs: its parts end to end."""
        if not self.asked:
            return None
        if self.chat:
            return {"content": [entry for part in parts if part for entry in part["content"]]}
        return merge_parts([part for part in parts if part])
