"""What one request or one client may take of the server, and the `myvllm serve` flags that
set it (docs/reliability.md lists each limit, its refusal and its test)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

DEFAULT_MAX_RESPONSE_BYTES = 64 << 20  # response_bounds.py
DEFAULT_TIMEOUT_REQUEST_BODY_S = 60.0


@dataclass(frozen=True)
class ServerLimits:
    max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES
    """The largest answer taken, in bytes of JSON as estimated from the request (n, echo,
    the prompts, max_tokens, logprobs): a larger one is a 400 before it is queued."""
    max_connections: int | None = None
    """The most connections held at once; past it a new one gets a 503 at once and is
    closed (connection_limits.py). None: the open-file limit (its soft limit raised to the
    hard one at start) less 256."""
    timeout_request_body_s: float = DEFAULT_TIMEOUT_REQUEST_BODY_S
    """Seconds a request's whole body has to arrive in, however it trickles: a 408 after."""

    def __post_init__(self) -> None:
        for name in ("max_response_bytes", "max_connections"):
            value = getattr(self, name)
            if value is None and name == "max_connections":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{_flag(name)} {value!r}: allowed: an integer >= 1")
        value = self.timeout_request_body_s
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"{_flag('timeout_request_body_s')} {value!r}: allowed: a "
                             "number of seconds > 0")


def _flag(name: str) -> str:
    return "--" + name.removesuffix("_s").replace("_", "-")


def add_server_limit_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server limits")
    group.add_argument("--max-response-bytes", type=int, metavar="BYTES",
                       default=DEFAULT_MAX_RESPONSE_BYTES,
                       help="the largest answer taken, estimated from the request (n, echo, "
                            "prompt lengths, max_tokens, logprobs); a larger one is a 400 "
                            "that says how large it would be (default: %(default)s, 64 MiB)")
    group.add_argument("--max-connections", type=int, metavar="N", default=None,
                       help="the most connections held at once; a new one past it gets a "
                            "503 at once (default: the open-file limit, raised to its hard "
                            "limit at start, less 256)")
    group.add_argument("--timeout-request-body", type=float, metavar="SECONDS",
                       default=DEFAULT_TIMEOUT_REQUEST_BODY_S,
                       help="seconds a request's whole body has to arrive in, however it "
                            "trickles; a 408 after (default: %(default)s)")


def server_limits(args: argparse.Namespace) -> ServerLimits:
    """The limits `myvllm serve`'s flags ask for (ValueError: a value not allowed)."""
    return ServerLimits(max_response_bytes=args.max_response_bytes,
                        max_connections=args.max_connections,
                        timeout_request_body_s=args.timeout_request_body)
