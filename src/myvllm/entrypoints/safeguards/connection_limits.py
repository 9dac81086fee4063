"""Connections bounded below the open-file limit, refused with a quick 503 beyond it.

Every connection holds a file descriptor. About 21,000 held connections reached the
process's limit of 20,000 open files: new clients then timed out, and the model's files,
the sockets to the engine core and the log could not be opened either. At start the soft
limit is raised to the hard one (raise_open_file_limit), and the server takes at most
max_connections at once, by default the open-file limit less OPEN_FILES_HEADROOM for
everything else. A connection past it gets at once a 503 in OpenAI's error shape and is
closed (refuse_connection): its descriptor is free again within REFUSED_CLOSE_S.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource

OPEN_FILES_HEADROOM = 256  # the process's other files: libraries, the core's sockets, logs
MIN_MAX_CONNECTIONS = 16
REFUSED_CLOSE_S = 2.0  # a refused connection still sending is closed this long after the 503
# uvicorn's logger: its lines are rate-limited (log_rate_limit.py), a flood writes a few.
logger = logging.getLogger("uvicorn.error")


def raise_open_file_limit() -> int:
    """Raise RLIMIT_NOFILE's soft limit to its hard one; the open-file limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):  # e.g. a container's own cap: keep the soft limit
            pass
    return soft


def default_max_connections(open_file_limit: int) -> int:
    return max(MIN_MAX_CONNECTIONS, open_file_limit - OPEN_FILES_HEADROOM)


def check_max_connections(max_connections: int, open_file_limit: int) -> None:
    """ValueError when max_connections leaves no file descriptors for the rest."""
    most = open_file_limit - MIN_MAX_CONNECTIONS
    if max_connections > most:
        raise ValueError(f"--max-connections {max_connections} is more than the open-file "
                         f"limit ({open_file_limit}) allows; allowed: at most {most}")


def _refusal(max_connections: int) -> bytes:
    body = json.dumps({"error": {
        "message": f"the server is at its limit of {max_connections} connections "
                   "(--max-connections): try again later",
        "type": "ServiceUnavailableError", "param": None, "code": 503}}).encode()
    return (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
            b"connection: close\r\nretry-after: 1\r\ncontent-length: "
            + str(len(body)).encode() + b"\r\n\r\n" + body)


def refuse_connection(transport: asyncio.Transport, loop: asyncio.AbstractEventLoop,
                      max_connections: int) -> None:
    """Answer a connection over the limit with a 503 before it sends anything, then end it:
    the 503 is followed by the end of our side of the stream, so that a client still sending
    its request reads the answer rather than a reset; what it sends is dropped, and the
    connection is closed when it closes its side or REFUSED_CLOSE_S later."""
    logger.warning("a connection refused with a 503: the server holds its limit of %d "
                   "connections (--max-connections)", max_connections)
    transport.write(_refusal(max_connections))
    if transport.can_write_eof():
        transport.write_eof()
    loop.call_later(REFUSED_CLOSE_S, transport.close)
