"""What one request or one client may take of the server, and the `myvllm serve` flags that
set it (docs/reliability.md lists each limit, its refusal and its test)."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

DEFAULT_MAX_RESPONSE_BYTES = 64 << 20  # response_bounds.py


@dataclass(frozen=True)
class ServerLimits:
    max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES
    """The largest answer taken, in bytes of JSON as estimated from the request (n, echo,
    the prompts, max_tokens, logprobs): a larger one is a 400 before it is queued."""

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                flag = "--" + field.name.replace("_", "-")
                raise ValueError(f"{flag} {value!r}: allowed: an integer >= 1")


def add_server_limit_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server limits")
    group.add_argument("--max-response-bytes", type=int, metavar="BYTES",
                       default=DEFAULT_MAX_RESPONSE_BYTES,
                       help="the largest answer taken, estimated from the request (n, echo, "
                            "prompt lengths, max_tokens, logprobs); a larger one is a 400 "
                            "that says how large it would be (default: %(default)s, 64 MiB)")


def server_limits(args: argparse.Namespace) -> ServerLimits:
    """The limits `myvllm serve`'s flags ask for (ValueError: a value not allowed)."""
    return ServerLimits(max_response_bytes=args.max_response_bytes)
