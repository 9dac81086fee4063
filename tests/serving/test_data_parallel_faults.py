"""`myvllm serve --data-parallel-size 2` when a replica dies, and on SIGTERM: no process of
the server outlives it.

    a replica's core killed   the streams on both replicas end with an error event and
                              [DONE] (the one on the dead replica: its core died; the other:
                              the engine is taken for dead as a whole), and the server exits 1
                              within 10 s, its other core gone with it
    SIGTERM                   streams aborted, exit 0, both cores (and their workers) gone

The real command in a subprocess with a tiny random Qwen3 (slow: two cores start).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from test_cli import (alive, descendants, engine_children, free_port,  # noqa: F401
                      serve_subprocess, tiny_path)  # tiny_path: a fixture

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not Path("/proc").is_dir(),
                                 reason="reads the process table from /proc")]

EXIT_LIMIT_S = 10.0


@pytest.fixture
def server(tiny_path: Path) -> Iterator[tuple[subprocess.Popen[str], int]]:  # noqa: F811
    port = free_port()
    with serve_subprocess([str(tiny_path), "--num-kvcache-blocks", "64", "--log-level",
                           "warning", "--data-parallel-size", "2"], port) as proc:
        yield proc, port


def open_stream(port: int, prompt: str) -> Any:
    import http.client

    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    body = {"prompt": prompt, "max_tokens": 200, "ignore_eos": True, "stream": True}
    connection.request("POST", "/v1/completions", json.dumps(body),
                       {"content-type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200
    assert response.readline().startswith(b"data: ")
    return response


def last_events(response: Any) -> list[str]:
    return [line.strip() for line in response.read().decode().splitlines() if line]


def wait_gone(pids: list[int]) -> None:
    deadline = time.monotonic() + EXIT_LIMIT_S
    while any(alive(pid) for pid in pids):
        assert time.monotonic() < deadline, f"left behind: {[p for p in pids if alive(p)]}"
        time.sleep(0.1)


def test_a_replica_killed_fails_the_requests_and_the_server_exits_1(
        server: tuple[subprocess.Popen[str], int]) -> None:
    proc, port = server
    cores = engine_children(proc.pid)
    assert len(cores) == 2, cores
    left = descendants(proc.pid)
    # Shorter than a block: the least loaded replica each, so one stream on each.
    streams = [open_stream(port, "one"), open_stream(port, "two")]
    killed_at = time.monotonic()
    os.kill(cores[1], signal.SIGKILL)
    messages = []
    for response in streams:
        events = last_events(response)
        assert events[-1] == "data: [DONE]"
        error = json.loads(events[-2].removeprefix("data: "))["error"]
        assert error["code"] == 503
        messages.append(error["message"])
    assert any("engine core process died (killed by SIGKILL)" in m for m in messages)
    assert any("data-parallel replica" in m for m in messages), messages
    output = proc.communicate(timeout=EXIT_LIMIT_S)[0]
    assert time.monotonic() - killed_at < EXIT_LIMIT_S
    assert proc.returncode == 1, output[-3000:]
    assert "data-parallel replica" in output and "the server stops" in output, output[-3000:]
    wait_gone(left)


def test_sigterm_aborts_both_replicas_streams_and_leaves_no_process(
        server: tuple[subprocess.Popen[str], int]) -> None:
    proc, port = server
    left = descendants(proc.pid)
    assert len(left) == 2, left
    streams = [open_stream(port, "one"), open_stream(port, "two")]
    proc.send_signal(signal.SIGTERM)
    for response in streams:
        events = last_events(response)
        assert events[-1] == "data: [DONE]"
        last = json.loads(events[-2].removeprefix("data: "))
        assert last["choices"][0]["finish_reason"] == "abort"
    output = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, output[-3000:]
    wait_gone(left)
