"""`myvllm serve` when one of its processes dies: the engine core (kill -9) or the front end.

    core killed mid-stream   the stream ends with an error event and [DONE], a request
                             waiting for a whole answer gets a 503, /health answers 503 (or
                             the port is closed already), and the server exits 1 within 10 s
                             with a line that says why, for a supervisor to restart it
    front end killed         the core process (and its tensor-parallel workers) notice and
                             exit by themselves within 10 s: nothing is left holding the GPU

Each test starts the real command in a subprocess with a tiny random Qwen3 (tens of seconds
on a 2-core CPU: they are in the slow set; test_server_dead_engine.py kills the core of a
server run in a thread in the quick set).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from test_cli import (alive, descendants, engine_children, free_port, health,  # noqa: F401
                      open_stream, serve_subprocess, tiny_path)  # tiny_path: a fixture
from test_server import metrics, wait_for

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not Path("/proc").is_dir(),
                                 reason="reads the process table from /proc")]

EXIT_LIMIT_S = 10.0  # the bound for every "exits by itself"


def in_engine(port: int) -> float:
    """Requests running or waiting in the engine core, as /metrics counts them."""
    counts = metrics(f"http://127.0.0.1:{port}")
    return counts["myvllm:num_requests_running"] + counts["myvllm:num_requests_waiting"]


@pytest.fixture
def server(tiny_path: Path, request: pytest.FixtureRequest) -> Iterator[tuple[subprocess.Popen[str], int]]:  # noqa: F811
    port = free_port()
    extra = getattr(request, "param", [])
    with serve_subprocess([str(tiny_path), "--num-kvcache-blocks", "64", "--log-level",
                           "warning", *extra], port) as proc:
        yield proc, port


def test_core_killed_mid_stream(server: tuple[subprocess.Popen[str], int]) -> None:
    proc, port = server
    (core,) = engine_children(proc.pid)
    response = open_stream(port)
    whole: dict[str, object] = {}

    def whole_answer() -> None:  # a non-streamed request in flight when the core dies
        body = json.dumps({"prompt": "whole", "max_tokens": 200, "ignore_eos": True}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                         {"content-type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=60) as r:
                whole["status"] = r.status
        except urllib.error.HTTPError as e:
            whole["status"], whole["body"] = e.code, json.loads(e.read())

    waiting = threading.Thread(target=whole_answer)
    waiting.start()
    # Both requests in the engine (queued or decoding), then the kill at once. (A fixed
    # half-second wait instead let the stream's 200 tokens finish first on a quiet machine.)
    wait_for(lambda: in_engine(port) == 2, "the whole answer's request to reach the engine")
    killed_at = time.monotonic()
    os.kill(core, signal.SIGKILL)

    events = [line.strip() for line in response.read().decode().splitlines() if line]
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert error["code"] == 503 and "engine core process died" in error["message"]
    waiting.join(30)
    assert whole["status"] == 503, whole
    assert health(port) in (503, None)  # unhealthy, or gone already

    output = proc.communicate(timeout=EXIT_LIMIT_S)[0]
    assert time.monotonic() - killed_at < EXIT_LIMIT_S
    assert proc.returncode == 1, output[-3000:]
    assert "engine core process died (killed by SIGKILL)" in output


@pytest.mark.parametrize("server", [["--tensor-parallel-size", "2"]], indirect=True,
                         ids=["tp2"])
def test_front_end_killed(server: tuple[subprocess.Popen[str], int]) -> None:
    proc, port = server
    left = descendants(proc.pid)  # the core, and its workers under tensor parallelism
    assert left
    open_stream(port)  # the core is busy when its front end goes
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + EXIT_LIMIT_S
    while any(alive(pid) for pid in left):
        assert time.monotonic() < deadline, f"left behind: {[p for p in left if alive(p)]}"
        time.sleep(0.1)
