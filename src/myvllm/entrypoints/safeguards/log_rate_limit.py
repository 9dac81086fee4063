"""Errors of one kind logged once per interval, with a count, never a line each.

A flood of bad requests or refused connections used to write a line each: about 21,000 held
connections grew the log by some 1.2 million lines (~100 MB) in under a minute. Here the
first `burst` lines of a kind in an interval of LOG_INTERVAL_S are written; the others are
counted, and the first line of that kind in a later interval says how many were left out.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Hashable

LOG_INTERVAL_S = 10.0
MAX_KINDS = 1024  # kinds remembered; past it the oldest is forgotten (its count lost)


class LogRateLimiter:
    """Which lines of each kind to write: admit(kind) is None for a line to leave out, else
    the number of that kind's lines left out before it (since the last one written). At
    most `burst` lines of a kind per interval_s."""

    def __init__(self, interval_s: float = LOG_INTERVAL_S, burst: int = 1) -> None:
        self.interval_s = interval_s
        self.burst = burst
        # kind -> (its interval's start, lines written in it, lines left out since)
        self._kinds: dict[Hashable, tuple[float, int, int]] = {}
        self._lock = threading.Lock()  # uvicorn's loggers are called from threads too

    def admit(self, kind: Hashable) -> int | None:
        now = time.monotonic()
        with self._lock:
            start, written, left_out = self._kinds.pop(kind, (-self.interval_s, 0, 0))
            if now - start >= self.interval_s:  # a new interval
                start, written = now, 0
            if written >= self.burst:
                self._kinds[kind] = (start, written, left_out + 1)
                return None
            if len(self._kinds) >= MAX_KINDS:
                del self._kinds[next(iter(self._kinds))]
            self._kinds[kind] = (start, written + 1, 0)
            return left_out


def with_count(line: str, left_out: int) -> str:
    if not left_out:
        return line
    return f"{line} (and {left_out} more like it before, not logged)"


class RateLimitFilter(logging.Filter):
    """A logging filter: records of WARNING or above are of one kind when they share their
    logger, level and message template (record.msg before its arguments)."""

    def __init__(self, interval_s: float = LOG_INTERVAL_S, burst: int = 1) -> None:
        super().__init__()
        self.limiter = LogRateLimiter(interval_s, burst)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        left_out = self.limiter.admit((record.name, record.levelno, str(record.msg)))
        if left_out is None:
            return False
        # (The count's text holds no "%": the template still takes the record's args.)
        record.msg = with_count(str(record.msg), left_out)
        return True


# uvicorn's errors (refused or broken connections, bad requests it answers itself) and
# asyncio's (accept() failing when the process runs out of open files).
RATE_LIMITED_LOGGERS = ("uvicorn.error", "asyncio")
SERVER_LOG_BURST = 5  # lines of one kind per interval


def rate_limit_server_logs(interval_s: float = LOG_INTERVAL_S) -> None:
    """Put a RateLimitFilter on the loggers of RATE_LIMITED_LOGGERS (once per process)."""
    for name in RATE_LIMITED_LOGGERS:
        target = logging.getLogger(name)
        if not any(isinstance(f, RateLimitFilter) for f in target.filters):
            target.addFilter(RateLimitFilter(interval_s, SERVER_LOG_BURST))
