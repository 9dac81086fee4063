"""Incremental detokenization: turn a stream of token ids into a stream of text deltas.

Decoding each new token on its own is wrong in two ways:

  * multi-byte characters: byte-level tokenizers split one UTF-8 character over several
    tokens ("€" = e2 82 ac can be three tokens). Decoding the first one alone gives "\ufffd";
    the character exists only once all its bytes are there.
  * merged tokens: a token's text can depend on its neighbours. SentencePiece writes a word's
    leading space as "▁" and the decoder strips the space at the start of a string, so
    decode(["▁world"]) is "world" but decode(["▁Hello", "▁world"]) is "Hello world".

So each step decodes a short window of recent tokens twice, with and without the new ones,
and the new text is the difference (the method of vLLM and HF text-generation-inference):

    tokens    ... t5 t6 t7 | t8 t9          prefix_offset = 5, read_offset = 8
                  ^prefix    ^new
    prefix_text = decode(t5..t7)            new_full = decode(t5..t9)
    delta = new_full[len(prefix_text):]     unless new_full ends with "\ufffd" (wait)

When a delta is emitted the window slides forward. The window starts on the last few prompt
tokens, so the first completion token is decoded in context as well.

Stop strings are matched on the text, not the tokens: a stop string may span several tokens
or end in the middle of one. The output ends right before its first occurrence. While
streaming, text that could be the start of a stop string ("Obs" when the stop string is
"Observation:") is held back until the next tokens show whether it is.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

# Prompt tokens decoded in front of the first completion tokens (vLLM uses 5): enough for a
# SentencePiece word boundary, or a character whose first bytes ended the prompt.
PROMPT_CONTEXT_TOKENS = 5

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Text deltas of one request's completion, with its stop strings applied.

        detok = IncrementalDetokenizer(tokenizer, prompt_token_ids, stop=["\\n\\n"])
        for new_ids in token_stream:
            delta = detok.add_tokens(new_ids)    # text safe to show now ("" while waiting)
            if detok.stopped: break              # a stop string was found: the request is done
        delta = detok.finish()                   # the rest, once the request has finished

    The deltas add up to ``output_text``. ``num_tokens`` counts the completion tokens that
    were consumed (tokens after the one that completed a stop string are ignored).
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int],
                 stop: Iterable[str] = (), skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop: list[str] = [s for s in stop]
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop strings must be non-empty strings, got {self.stop!r}")
        self._max_stop_len = max((len(s) for s in self.stop), default=0)
        context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._tokens: list[int] = context  # the window's tokens, then the completion's
        self._prefix_offset = 0
        self._read_offset = len(context)
        self.output_text = ""  # completion text so far (cut at a stop string)
        self._emitted = 0  # characters of output_text already returned as deltas
        self.num_tokens = 0
        self.stopped = False  # a stop string matched; output_text ends right before it
        self.stop_string: str | None = None

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)

    def _decode_new(self, flush: bool) -> str:
        """Text of the tokens after read_offset, or "" while it ends inside a character."""
        prefix_text = self._decode(self._tokens[self._prefix_offset:self._read_offset])
        full_text = self._decode(self._tokens[self._prefix_offset:])
        if len(full_text) <= len(prefix_text) or (full_text.endswith(REPLACEMENT_CHAR)
                                                  and not flush):
            # Nothing new yet (a special token, or the first bytes of a character).
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._tokens)
        return full_text[len(prefix_text):]

    def add_tokens(self, token_ids: Iterable[int]) -> str:
        """Consume new completion tokens; return the text that can be shown now."""
        if not self.stop:
            # No stop string to find the token it ends at: the tokens of several steps (a
            # front end that fell behind) are decoded as one window, two decodes in all.
            before = len(self._tokens)
            self._tokens.extend(token_ids)
            self.num_tokens += len(self._tokens) - before
            self._append_text(self._decode_new(flush=False))
            return self._take(final=False)
        for token_id in token_ids:
            if self.stopped:
                break
            self._tokens.append(token_id)
            self.num_tokens += 1
            self._append_text(self._decode_new(flush=False))
        return self._take(final=self.stopped)

    def finish(self) -> str:
        """The request has finished: return all text not returned yet (even a partial
        character, which shows as "\ufffd", as a full decode of the tokens would)."""
        if not self.stopped and self._read_offset < len(self._tokens):
            self._append_text(self._decode_new(flush=True))
        return self._take(final=True)

    def _append_text(self, text: str) -> None:
        if not text:
            return
        start = max(0, len(self.output_text) - self._max_stop_len + 1)
        self.output_text += text
        if not self.stop:
            return
        # Only the region the new text can have completed a stop string in is searched.
        found = [(i, s) for s in self.stop if (i := self.output_text.find(s, start)) != -1]
        if found:
            index, stop = min(found)
            # Nothing from index on was emitted: it was a start of this stop string, held back.
            self.output_text = self.output_text[:index]
            self.stopped = True
            self.stop_string = stop

    def _held_back(self) -> int:
        """Length of the longest end of output_text that begins some stop string."""
        text = self.output_text
        longest = 0
        for stop in self.stop:
            for n in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:n]):
                    longest = n
                    break
        return longest

    def _take(self, final: bool) -> str:
        end = len(self.output_text) if final else len(self.output_text) - self._held_back()
        delta = self.output_text[self._emitted:end]
        self._emitted = max(self._emitted, end)
        return delta


def token_texts(tokenizer: Any, token_ids: Sequence[int]) -> list[str]:
    """Each token's own text, decoded alone with special tokens kept: what logprobs name a
    token by (OpenAI's `tokens` and `top_logprobs` keys; their lengths make `text_offset`),
    as vLLM does. A token that holds only part of a UTF-8 character decodes to "\ufffd",
    and the pieces of a SentencePiece word lose their leading space, so these texts need
    not add up to the decoded text. With no tokenizer, vLLM's "token_id:N"."""
    if tokenizer is None:
        return [f"token_id:{t}" for t in token_ids]
    return list(tokenizer.batch_decode([[t] for t in token_ids]))
