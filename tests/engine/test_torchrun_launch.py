"""Tensor parallelism launched by torchrun: every rank a process torchrun started.

    the environment (quick)   torchrun's variables read, a partial or malformed set and a
                              WORLD_SIZE other than tensor_parallel_size refused with a
                              message naming them, before any model is read
    two "hosts" (slow)        two torchrun launches (--nnodes 2, node ranks 0 and 1, one
                              process each) over gloo on this machine, standing in for two
                              hosts: the same script on both, LLM(...) on rank 0 gives the
                              greedy tokens of tensor_parallel_size 1 in one process, and
                              rank 1's torchrun exits 0 when rank 0's script ends
    rank 0 killed (slow)      rank 1 ends on its own (its torchrun knows nothing of the other
                              host): its liveness connection to rank 0 closed
    myvllm serve (slow)       the same command on both launches: rank 0 serves, the
                              completion's text is that of size 1; SIGTERM to the server
                              (rank 0) ends both launches with code 0

torchrun is the venv's own (it ships with torch), run as a subprocess with --master-addr
127.0.0.1 and a free port.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from helpers_models import tiny_checkpoint
from test_engine import GREEDY, random_prompts

from myvllm import LLM
from myvllm.entrypoints.cli import main as cli_main
from myvllm.utils.distributed import (TORCHRUN_VARS, check_torchrun_world_size,
                                      local_device_index, torchrun_env)

TORCHRUN = str(Path(sys.executable).parent / "torchrun")
ENGINE_KW: dict[str, Any] = dict(block_size=4, max_model_length=64, max_num_batched_tokens=64)
# A launch still running this long after it should have ended counts as hung (rank 1 notices
# rank 0's end within about a second; torch and the model take most of a start on this CPU).
END_LIMIT_S = 60.0
START_LIMIT_S = 300.0


# ================================================================== the environment
@pytest.fixture
def torchrun_vars(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in TORCHRUN_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def set_launch(monkeypatch: pytest.MonkeyPatch, **values: Any) -> None:
    base = dict(RANK=1, WORLD_SIZE=2, LOCAL_RANK=0, MASTER_ADDR="10.0.0.1", MASTER_PORT=29500)
    base.update(values)
    for name, value in base.items():
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, str(value))


def test_no_torchrun_variables_is_no_launch(torchrun_vars: pytest.MonkeyPatch) -> None:
    assert torchrun_env() is None
    assert local_device_index(3) == 3  # every rank spawned on this host: cuda:rank
    check_torchrun_world_size(None, 4)


def test_torchrun_variables_are_read(torchrun_vars: pytest.MonkeyPatch) -> None:
    set_launch(torchrun_vars, RANK=3, WORLD_SIZE=4, LOCAL_RANK=1)
    env = torchrun_env()
    assert env is not None
    assert (env.rank, env.world_size, env.local_rank) == (3, 4, 1)
    assert (env.master_addr, env.master_port) == ("10.0.0.1", 29500)
    assert local_device_index(3) == 1  # the second GPU of its host, not cuda:3


@pytest.mark.parametrize("values, message", [
    (dict(LOCAL_RANK=None), "LOCAL_RANK not set"),
    (dict(MASTER_ADDR=None, MASTER_PORT=None), "MASTER_ADDR, MASTER_PORT not set"),
    (dict(RANK="one"), "RANK='one' must be an integer"),
    (dict(RANK=2), r"RANK=2 must be in \[0, WORLD_SIZE=2\)"),
    (dict(LOCAL_RANK=-1), "LOCAL_RANK=-1 must be in"),
    (dict(MASTER_PORT=70000), "MASTER_PORT=70000 is not a TCP port"),
])
def test_bad_torchrun_variables_are_named(torchrun_vars: pytest.MonkeyPatch,
                                          values: dict[str, Any], message: str) -> None:
    set_launch(torchrun_vars, **values)
    with pytest.raises(ValueError, match=message):
        torchrun_env()


def test_world_size_other_than_tensor_parallel_size_is_refused(
        torchrun_vars: pytest.MonkeyPatch) -> None:
    set_launch(torchrun_vars, RANK=0, WORLD_SIZE=2)
    path = str(tiny_checkpoint("qwen3"))
    message = "torchrun started WORLD_SIZE=2 processes but tensor_parallel_size is 1"
    with pytest.raises(ValueError, match=message):  # before any weight is read
        LLM(path, **ENGINE_KW)


def test_the_command_refuses_a_bad_launch(torchrun_vars: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    set_launch(torchrun_vars, WORLD_SIZE=4, RANK=1)
    path = str(tiny_checkpoint("qwen3"))
    assert cli_main(["serve", path, "--tensor-parallel-size", "2"]) == 2
    assert "pass --tensor-parallel-size 4" in capsys.readouterr().err


# ================================================================== two launches, two "hosts"
RANK_SCRIPT = textwrap.dedent("""
    import json, os, sys, time
    from myvllm import LLM, SamplingParams

    path, prompts_json, out, then_sleep = sys.argv[1:5]
    # On rank 1, LLM(...) serves rank 0's calls and ends the process when rank 0 exits.
    llm = LLM(path, tensor_parallel_size=2, block_size=4, max_model_length=64,
              max_num_batched_tokens=64)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outputs = llm.generate(json.loads(prompts_json), params, use_tqdm=False)
    with open(out + ".tmp", "w") as f:
        json.dump({"pid": os.getpid(), "tokens": [o["token_ids"] for o in outputs]}, f)
    os.replace(out + ".tmp", out)
    if then_sleep == "sleep":
        time.sleep(600)
""")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def launch_node(node_rank: int, port: int, command: list[str], log: Path) -> subprocess.Popen:
    """One torchrun launch standing in for one host: one process, node rank node_rank."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for name in TORCHRUN_VARS:  # this test's own launch, not one we may run under
        env.pop(name, None)
    with open(log, "w") as out:
        return subprocess.Popen(
            [TORCHRUN, "--nnodes", "2", "--node-rank", str(node_rank), "--nproc-per-node", "1",
             "--master-addr", "127.0.0.1", "--master-port", str(port), *command],
            stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def stop(process: subprocess.Popen) -> None:
    """Kill a launch and everything it started (its own session)."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def wait_for_file(path: Path, nodes: list[subprocess.Popen], logs: list[Path]) -> Any:
    deadline = time.monotonic() + START_LIMIT_S
    while not path.exists():
        ended = [i for i, node in enumerate(nodes) if node.poll() is not None]
        assert not ended and time.monotonic() < deadline, (
            "no output from rank 0; node logs:\n" + "\n".join(
                f"--- node {i} ---\n{log.read_text()[-3000:]}" for i, log in enumerate(logs)))
        time.sleep(0.5)
    return json.loads(path.read_text())


def exit_code(process: subprocess.Popen, log: Path) -> int:
    try:
        return process.wait(timeout=END_LIMIT_S)
    except subprocess.TimeoutExpired:
        stop(process)
        raise AssertionError(f"still running {END_LIMIT_S:.0f} s after rank 0 ended:\n"
                             + log.read_text()[-3000:]) from None


@pytest.fixture(scope="module")
def expected() -> tuple[str, list[list[int]], list[list[int]], list[str]]:
    """(checkpoint, prompts, greedy tokens and texts of tensor_parallel_size 1)."""
    path = str(tiny_checkpoint("qwen3"))
    prompts = random_prompts([7, 13, 4])
    single = LLM(path, **ENGINE_KW).generate(prompts, GREEDY, use_tqdm=False)
    return path, prompts, [o["token_ids"] for o in single], [o["text"] for o in single]


def run_two_hosts(tmp_path: Path, path: str, prompts: list[list[int]], then: str
                  ) -> tuple[list[subprocess.Popen], list[Path], Any]:
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    out = tmp_path / "rank0.json"
    port = free_port()
    logs = [tmp_path / f"node{i}.log" for i in range(2)]
    command = [str(script), path, json.dumps(prompts), str(out), then]
    nodes = [launch_node(i, port, command, logs[i]) for i in range(2)]
    try:
        return nodes, logs, wait_for_file(out, nodes, logs)
    except BaseException:
        for node in nodes:
            stop(node)
        raise


@pytest.mark.slow
def test_two_hosts_give_the_tokens_of_one_rank(tmp_path: Path, expected: Any) -> None:
    path, prompts, tokens, _ = expected
    nodes, logs, result = run_two_hosts(tmp_path, path, prompts, then="exit")
    try:
        assert result["tokens"] == tokens
        assert exit_code(nodes[0], logs[0]) == 0
        assert exit_code(nodes[1], logs[1]) == 0  # rank 0 asked rank 1 to exit
    finally:
        for node in nodes:
            stop(node)


@pytest.mark.slow
def test_rank_1_exits_when_rank_0_is_killed(tmp_path: Path, expected: Any) -> None:
    path, prompts, tokens, _ = expected
    nodes, logs, result = run_two_hosts(tmp_path, path, prompts, then="sleep")
    try:
        assert result["tokens"] == tokens
        assert nodes[1].poll() is None  # rank 1 waits for rank 0's next call
        os.kill(result["pid"], signal.SIGKILL)  # no exit(), no finalizer: only its sockets
        assert exit_code(nodes[1], logs[1]) != 0
        assert "rank 0 closed its connection" in logs[1].read_text()
    finally:
        for node in nodes:
            stop(node)


def rank_process(node: subprocess.Popen) -> int:
    """The pid of the one process a torchrun launch started (its agent's only child)."""
    children = [int(pid) for task in Path(f"/proc/{node.pid}/task").iterdir()
                for pid in (task / "children").read_text().split()]
    assert len(children) == 1, children
    return children[0]


def post_json(url: str, body: dict[str, Any]) -> Any:
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def wait_healthy(url: str, nodes: list[subprocess.Popen], logs: list[Path]) -> None:
    deadline = time.monotonic() + START_LIMIT_S
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        ended = [i for i, node in enumerate(nodes) if node.poll() is not None]
        assert not ended and time.monotonic() < deadline, (
            "the server did not start; node logs:\n" + "\n".join(
                f"--- node {i} ---\n{log.read_text()[-3000:]}" for i, log in enumerate(logs)))
        time.sleep(1)


@pytest.mark.slow
def test_serve_on_two_hosts(tmp_path: Path, expected: Any) -> None:
    path, prompts, _, texts = expected
    port, http_port = free_port(), free_port()
    logs = [tmp_path / f"node{i}.log" for i in range(2)]
    command = ["-m", "myvllm.entrypoints.cli", "serve", path, "--port", str(http_port),
               "--tensor-parallel-size", "2", "--block-size", "4", "--max-model-length", "64",
               "--max-num-batched-tokens", "64"]
    nodes = [launch_node(i, port, command, logs[i]) for i in range(2)]
    try:
        url = f"http://127.0.0.1:{http_port}"
        wait_healthy(url, nodes, logs)
        assert nodes[1].poll() is None
        reply = post_json(url + "/v1/completions", {
            "model": path, "prompt": prompts[0], "max_tokens": 12, "temperature": 0.0,
            "ignore_eos": True})
        assert reply["choices"][0]["text"] == texts[0]
        os.kill(rank_process(nodes[0]), signal.SIGTERM)  # the server's own way out
        assert exit_code(nodes[0], logs[0]) == 0
        assert exit_code(nodes[1], logs[1]) == 0  # rank 0 asked rank 1 to exit
    finally:
        for node in nodes:
            stop(node)
