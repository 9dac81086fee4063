"""Worker processes end with the engine, however the engine ends (tensor_parallel_size 2, gloo).

    exit()                              -> workers asked to leave, joined
    del llm; gc.collect()               -> weakref.finalize runs the same shutdown
    an exception inside a step          -> generate() re-raises it, workers are stopped
    KeyboardInterrupt during generate() -> same (ranks may be mid-collective: no reuse)
    a worker killed while idle          -> noticed at once, the next call refuses, says which
    (killed or crashing mid-step: test_worker_death.py)
    the parent killed with SIGKILL      -> workers notice the pipe / parent is gone, exit
    engine after engine                 -> TP 2, TP 2 again, TP 1: same tokens each time
    exit() returns                      -> every worker already gone, exit code 0, without
                                           its interpreter's exit (no atexit handler ran)

"Gone" is checked on the pid itself (os.kill(pid, 0) and /proc/<pid>/stat, a zombie counts
as gone), not only through multiprocessing's bookkeeping.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import select
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from helpers_models import tiny_checkpoint

from myvllm import LLM, SamplingParams
from helpers_blocks import used_block_ids

# Each test starts worker processes (or a whole engine in a subprocess), and each of those
# imports torch: seconds apiece on a 2-core CPU. `uv run pytest -m slow` runs them.
pytestmark = pytest.mark.slow

ENGINE_KW: dict[str, Any] = dict(block_size=4, max_model_length=32, max_num_batched_tokens=64)
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPTS = [[11, 12, 13, 14, 15], [21, 22, 23]]
START_TIMEOUT_S = 180.0  # a child engine that has not started by then has failed


@pytest.fixture(scope="module")
def path() -> str:
    return str(tiny_checkpoint("llama"))


@pytest.fixture(scope="module")
def expected(path: str) -> list[list[int]]:
    """The tokens of PROMPTS on a single-process engine."""
    llm = LLM(path, **ENGINE_KW)
    return [o["token_ids"] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def pid_alive(pid: int) -> bool:
    """True while any thread of process pid runs (a fully exited zombie counts as gone).

    Not just the main thread's state: a killed multi-threaded process shows its main thread
    as a zombie while the other threads (holding the sockets) are still exiting.
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
        states = [(task / "stat").read_text().rsplit(")", 1)[1].split()[0] for task in tasks]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False  # exited between the checks
    return any(state not in ("Z", "X") for state in states)


def wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    """Pids still alive after waiting up to timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = [pid for pid in pids if pid_alive(pid)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


def start_tp2(path: str) -> tuple[LLM, list[int]]:
    llm = LLM(path, tensor_parallel_size=2, **ENGINE_KW)
    assert llm.engine_core.workers is not None
    pids = [p.pid for p in llm.engine_core.workers.worker_processes]
    assert len(pids) == 1 and all(pid_alive(pid) for pid in pids)
    return llm, pids


def assert_all_gone(pids: list[int]) -> None:
    assert [pid for pid in pids if pid_alive(pid)] == []
    assert multiprocessing.active_children() == []
    assert not dist.is_initialized(), "the process group outlived the engine"


def fail_on_call(llm: LLM, n: int, exc: BaseException) -> None:
    """Make rank 0's ModelRunner.run raise exc on its n-th call (workers already sent 'run')."""
    original = llm.model_runner.run
    calls = 0

    def run(seqs: Any, is_prefill: bool) -> Any:
        nonlocal calls
        calls += 1
        if calls == n:
            raise exc
        return original(seqs, is_prefill)

    llm.model_runner.run = run  # type: ignore[method-assign]


# ================================================================== ending by an error
@pytest.mark.parametrize("exc", [RuntimeError("boom in step 3"), KeyboardInterrupt()],
                         ids=["exception", "keyboard_interrupt"])
def test_error_inside_generate(path: str, exc: BaseException) -> None:
    llm, pids = start_tp2(path)
    # Call 3 is a decode step: the worker is already inside it, waiting in a collective
    # for rank 0, which never comes. Shutdown must still end it.
    fail_on_call(llm, 3, exc)
    with pytest.raises(type(exc)) as info:
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert info.value is exc  # the caller sees the original error, not a shutdown error
    assert_all_gone(pids)
    assert not llm.scheduler.waiting and not llm.scheduler.running
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)


def test_worker_killed_while_idle(path: str) -> None:
    """The watchdog notices without any call; the next call refuses and says which worker."""
    llm, pids = start_tp2(path)
    os.kill(pids[0], signal.SIGKILL)
    deadline = time.monotonic() + 30
    while llm.dead_reason is None:
        assert time.monotonic() < deadline, "the death of an idle worker was not noticed"
        time.sleep(0.05)
    assert llm.dead_reason.startswith("tensor-parallel worker rank 1 died (killed by SIGKILL")
    with pytest.raises(RuntimeError, match=r"worker rank 1 died \(killed by SIGKILL"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert_all_gone(pids)


def test_keyboard_interrupt_single_process_engine_stays_usable(path: str,
                                                              expected: list[list[int]]) -> None:
    """Without workers nothing can be out of step: drop the batch, keep the engine."""
    llm = LLM(path, **ENGINE_KW)
    original = llm.model_runner.run
    fail_on_call(llm, 3, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    bm = llm.scheduler.block_manager
    assert not llm.scheduler.waiting and not llm.scheduler.running
    assert not used_block_ids(bm) and len(bm.free_block_ids) == len(bm.blocks)
    llm.model_runner.run = original  # type: ignore[method-assign]
    assert [o["token_ids"] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == expected


# ================================================================== the parent dies
CHILD = textwrap.dedent("""
    import sys, time
    from myvllm import LLM, SamplingParams

    if __name__ == "__main__":
        llm = LLM(sys.argv[1], tensor_parallel_size=2, block_size=4, max_model_length=32,
                  max_num_batched_tokens=64)
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8), use_tqdm=False)
        print(" ".join(str(p.pid) for p in llm.engine_core.workers.worker_processes), flush=True)
        time.sleep(600)
""")


def test_workers_exit_when_the_parent_is_killed(path: str, tmp_path: Path) -> None:
    script = tmp_path / "engine_then_sleep.py"
    script.write_text(CHILD)
    log = tmp_path / "child.log"
    with open(log, "w") as stderr:
        parent = subprocess.Popen([sys.executable, str(script), path], stdout=subprocess.PIPE,
                                  stderr=stderr, text=True)
    try:
        assert parent.stdout is not None
        # Wait for the line of worker pids, without hanging if the child never prints it.
        ready, _, _ = select.select([parent.stdout], [], [], START_TIMEOUT_S)
        line = parent.stdout.readline() if ready else ""
        assert line.strip(), (f"the child engine did not start (exit code {parent.poll()}):\n"
                              + log.read_text()[-3000:])
        pids = [int(pid) for pid in line.split()]
        assert pids and all(pid_alive(pid) for pid in pids)
        parent.kill()  # SIGKILL: no atexit, no finalizer, no chance to clean up
        parent.wait(timeout=10)
        # The workers see EOF on their pipe, or their parent pid change (checked each second).
        assert wait_gone(pids, 15) == []
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


# ================================================================== ending normally
def test_exit_gc_and_one_engine_after_another(path: str, expected: list[list[int]]) -> None:
    """TP 2 ended by exit(), TP 2 ended by garbage collection, then TP 1, in one process."""
    first, first_pids = start_tp2(path)
    # Bad input is refused on rank 0 before anything reaches the workers...
    with pytest.raises(ValueError, match="empty prompt"):
        first.generate([[]], GREEDY, use_tqdm=False)
    # ...so the workers are still in step and the next request works.
    assert [o["token_ids"] for o in first.generate(PROMPTS, GREEDY, use_tqdm=False)] == expected
    first.exit()
    assert_all_gone(first_pids)
    first.exit()  # idempotent
    with pytest.raises(RuntimeError, match="shut down"):
        first.generate(PROMPTS, GREEDY, use_tqdm=False)

    second, second_pids = start_tp2(path)
    assert set(second_pids).isdisjoint(first_pids)
    assert [o["token_ids"] for o in second.generate(PROMPTS, GREEDY, use_tqdm=False)] == expected
    del second  # no exit(): weakref.finalize stops the workers and frees the process group
    gc.collect()
    assert_all_gone(second_pids)

    third = LLM(path, **ENGINE_KW)
    assert third.engine_core.workers is None
    assert [o["token_ids"] for o in third.generate(PROMPTS, GREEDY, use_tqdm=False)] == expected
    assert multiprocessing.active_children() == []


# Imported by every interpreter started with it on PYTHONPATH (here: the engine's workers):
# says it started, and registers an atexit handler, which only the interpreter's own exit runs.
MARK_WORKER = textwrap.dedent("""
    import atexit, os, pathlib
    marks = pathlib.Path(__file__).parent
    (marks / f"started-{os.getpid()}").touch()
    atexit.register((marks / f"finalized-{os.getpid()}").touch)
""")


def test_exit_returns_with_every_worker_ended_without_the_interpreters_exit(
        path: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """exit() returns with the worker gone, exit code 0, and the worker skipped its
    interpreter's exit (no atexit handler ran): once its process group is destroyed it ends
    at once (utils/process_exit.py) instead of making rank 0 wait for that teardown."""
    (tmp_path / "sitecustomize.py").write_text(MARK_WORKER)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(tmp_path)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    llm, pids = start_tp2(path)
    assert [(tmp_path / f"started-{pid}").exists() for pid in pids] == [True]
    llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm.exit()
    assert_all_gone(pids)  # at once, not within a while
    assert [p.exitcode for p in llm.engine_core.workers.worker_processes] == [0]
    assert [(tmp_path / f"finalized-{pid}").exists() for pid in pids] == [False]


def test_worker_dying_at_start_up_is_reported(path: str, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker that dies before saying a word (here: in Python's start-up, via a
    sitecustomize that only the newly spawned interpreter reads) fails LLM() at once."""
    (tmp_path / "sitecustomize.py").write_text("import os\nos._exit(3)\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    with pytest.raises(RuntimeError,
                       match=r"worker rank 1 died \(exited with code 3\) during start-up"):
        LLM(path, tensor_parallel_size=2, **ENGINE_KW)
    assert_all_gone([])


def test_a_worker_error_inside_a_step_is_reported_with_its_traceback() -> None:
    """Rank 1 fails inside run() (it gets a garbage batch); rank 0's collective then fails
    and the engine raises the worker's own error, and no worker is left running."""
    llm = LLM(str(tiny_checkpoint("qwen3")), tensor_parallel_size=2, max_model_length=64,
              max_num_batched_tokens=128)
    pool = llm.engine_core.workers._pool
    original_send = pool.send

    def send_garbage_to_workers(method, *args):
        if method == "run":
            return original_send("run", "not a batch", *args[1:])
        return original_send(method, *args)

    pool.send = send_garbage_to_workers
    with pytest.raises(RuntimeError,
                       match=r"worker rank 1 died \(exited with code 1\) during run\(\)") as info:
        llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    assert "AttributeError" in str(info.value)
    assert multiprocessing.active_children() == []
