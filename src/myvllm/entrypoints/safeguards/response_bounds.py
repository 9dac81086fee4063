"""How large an answer may grow, checked before its request is queued.

An answer's size is the product of a few request fields: n choices per prompt, each with up
to max_tokens tokens (the prompt's too under completions' echo), and per token, when asked,
its logprob and its k alternatives'. n=128, echo and logprobs=20 on a 4,000-token prompt
make about 280 MB of JSON out of a 16 KB request, and building it took minutes. So the
server estimates the answer from those fields and refuses (400) one larger than its bound
(`--max-response-bytes`, 64 MiB by default), saying how large it would be.

The estimate uses the typical JSON size of each part (below), not the model's actual token
texts: a token's text of about 4 characters, a logprob of 17 digits. It is an estimate of
the whole answer, streamed or not (a stream adds each event's envelope, which is not counted).
"""

from __future__ import annotations

from collections.abc import Sequence

from myvllm.entrypoints.protocol import RequestError
from myvllm.sampling_parameters import SamplingParams

# A token's share of the JSON, separators included:
TOKEN_TEXT_BYTES = 7      # its text, quoted ("tok",), in a list or as a key
LOGPROB_BYTES = 20        # a logprob: -2.3025851249694824,
TEXT_OFFSET_BYTES = 7     # completions' text_offset: 12345,
ENTRY_BYTES = 2           # the braces of a completions top_logprobs dict
# chat: {"token":"tok","logprob":-2.3025851249694824,"bytes":[116,111,107]} and a comma;
# per token also "top_logprobs":[...] around its k alternatives of that shape.
CHAT_ENTRY_BYTES = 30 + TOKEN_TEXT_BYTES + LOGPROB_BYTES + 16
CHAT_TOP_LIST_BYTES = 18
CHOICE_BYTES = 160        # a choice's fields around its text and logprobs
ENVELOPE_BYTES = 320      # id, object, created, model, usage


def token_bytes(num_logprobs: int | None, chat: bool) -> int:
    """One token's share of its choice: its text and, with logprobs asked (k alternatives),
    its entries."""
    if num_logprobs is None:
        return TOKEN_TEXT_BYTES
    if chat:
        return TOKEN_TEXT_BYTES + CHAT_TOP_LIST_BYTES + (num_logprobs + 1) * CHAT_ENTRY_BYTES
    # tokens, token_logprobs, text_offset, and a dict of the k best and the token itself
    return (2 * TOKEN_TEXT_BYTES + LOGPROB_BYTES + TEXT_OFFSET_BYTES + ENTRY_BYTES
            + (num_logprobs + 1) * (TOKEN_TEXT_BYTES + LOGPROB_BYTES))


def estimate_response_bytes(prompt_lengths: Sequence[int], params: Sequence[SamplingParams],
                            chat: bool, echo: bool) -> int:
    """The answer's estimated size: each prompt's n choices, each of max_tokens tokens (and
    its prompt's tokens under echo, with their logprobs when prompt_logprobs is asked)."""
    total = ENVELOPE_BYTES
    for length, p in zip(prompt_lengths, params, strict=True):
        choice = CHOICE_BYTES + p.max_tokens * token_bytes(p.logprobs, chat)
        if echo:
            choice += length * token_bytes(p.prompt_logprobs, chat)
        total += p.n * choice
    return total


def check_response_size(prompt_lengths: Sequence[int], params: Sequence[SamplingParams],
                        chat: bool, echo: bool, max_response_bytes: int) -> None:
    """A RequestError (400) when the answer would be larger than max_response_bytes."""
    size = estimate_response_bytes(prompt_lengths, params, chat, echo)
    if size <= max_response_bytes:
        return
    p = params[0]  # a batch's prompts share their sampling fields
    longest = max(prompt_lengths) if echo else 0
    what = [f"{len(params) * p.n} choices of up to {p.max_tokens + longest:,} tokens"
            + (f" ({longest:,} of them the echoed prompt)" if echo else "")]
    asked = p.prompt_logprobs if echo and p.prompt_logprobs is not None else p.logprobs
    if asked is not None:
        what.append(f"{asked + 1} logprobs a token")
    raise RequestError(
        f"the answer would be about {_size(size)} ({size:,} bytes: {', '.join(what)}), more "
        f"than this server's limit of {_size(max_response_bytes)} (--max-response-bytes); "
        f"allowed: an answer of at most {max_response_bytes:,} bytes: ask for fewer choices "
        "(n), tokens (max_tokens) or logprobs, or no echo")


def _size(num_bytes: int) -> str:
    if num_bytes >= 1 << 20:
        return f"{num_bytes / (1 << 20):.1f} MiB"
    return f"{num_bytes / 1024:.1f} KiB"
