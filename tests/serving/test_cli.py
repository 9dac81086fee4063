"""The `myvllm` command: Config flags, the terminal chat, and a served process that ends
cleanly on SIGTERM (exit 0, streams closed, tensor-parallel workers gone)."""

from __future__ import annotations

import argparse
import os
import http.client
import json
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from helpers_models import build_tiny_checkpoint
from myvllm.config import Config
from myvllm.entrypoints import chat, cli

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import AutoTokenizer

    path = build_tiny_checkpoint("qwen3", tmp_path_factory.mktemp("tiny_chat"))
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(path))
    return path


def test_every_config_field_is_a_kebab_case_flag() -> None:
    parser = cli.build_parser()
    args = parser.parse_args(["serve", "some/model", "--max-model-length", "2048",
                              "--no-enable-prefix-caching", "--eos", "2,7", "--port", "9000"])
    config = cli.engine_config(args)
    assert config == Config(model="some/model", max_model_length=2048,
                            enable_prefix_caching=False, eos=(2, 7))
    assert args.port == 9000
    help_text = parser._subparsers._group_actions[0].choices["serve"].format_help()  # type: ignore
    for name in Config.field_names():
        if name != "model":
            assert "--" + name.replace("_", "-") in help_text, name
    # Flags not given keep Config's defaults.
    assert cli.engine_config(parser.parse_args(["chat", "m"])) == Config(model="m")


def test_vllms_flag_names_are_aliases(monkeypatch: pytest.MonkeyPatch) -> None:
    parser = cli.build_parser()
    args = parser.parse_args(["serve", "m", "--max-num-seqs", "7", "--max-model-len", "99"])
    assert cli.engine_config(args) == Config(model="m", max_num_sequences=7,
                                             max_model_length=99)
    help_text = parser._subparsers._group_actions[0].choices["serve"].format_help()  # type: ignore
    for both in ("--max-num-sequences MAX_NUM_SEQUENCES, --max-num-seqs",
                 "--max-model-length MAX_MODEL_LENGTH, --max-model-len"):
        assert both in help_text
    assert args.api_key is None and args.chat_template is None
    assert parser.parse_args(["serve", "--api-key", "k1"]).api_key == "k1"
    monkeypatch.setenv(cli.API_KEY_ENV, "from-env")
    parser = cli.build_parser()
    assert parser.parse_args(["serve"]).api_key == "from-env"
    assert parser.parse_args(["serve", "--api-key", "k1"]).api_key == "k1"


def test_serve_passes_the_key_and_the_template_file(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    template = tmp_path / "chat.jinja"
    template.write_text("{{ messages[0].content }}")
    (tmp_path / "config.json").write_text("{}")  # a checkpoint folder, as far as is checked
    calls: list[tuple[Any, ...]] = []
    monkeypatch.setattr(cli, "serve", lambda *a, **_: calls.append(a) or 0)
    assert cli.main(["serve", str(tmp_path), "--port", str(free_port()), "--api-key", "k1",
                     "--chat-template", str(template)]) == 0
    (args,) = calls
    assert args[-3:-1] == ("k1", "{{ messages[0].content }}")


def test_serve_passes_the_server_limits(tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from myvllm.entrypoints.safeguards.server_limits import ServerLimits

    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(cli, "serve", lambda *a, **k: calls.append(k) or 0)
    (tmp_path / "config.json").write_text("{}")  # a checkpoint folder, as far as is checked
    model = [str(tmp_path), "--port", str(free_port())]
    assert cli.main(["serve", *model, "--max-response-bytes", "1000"]) == 0
    assert calls[0]["limits"] == ServerLimits(max_response_bytes=1000)
    assert cli.main(["serve", *model]) == 0
    assert calls[1]["limits"] == ServerLimits()
    assert cli.main(["serve", *model, "--max-connections", "100",
                     "--timeout-request-body", "5"]) == 0
    assert calls[2]["limits"] == ServerLimits(max_connections=100, timeout_request_body_s=5.0)
    for bad in (["--max-response-bytes", "0"], ["--max-connections", "0"],
                ["--timeout-request-body", "0"]):
        assert cli.main(["serve", *model, *bad]) == 2  # before loading
    assert len(calls) == 3


def test_serve_passes_the_tool_and_reasoning_flags(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    from myvllm.entrypoints.chat_output_parsing import ChatOutputSettings

    calls: list[tuple[Any, ...]] = []
    monkeypatch.setattr(cli, "serve", lambda *a, **_: calls.append(a) or 0)
    (tmp_path / "config.json").write_text("{}")  # a checkpoint folder, as far as is checked
    model = [str(tmp_path), "--port", str(free_port())]
    assert cli.main(["serve", *model, "--enable-auto-tool-choice", "--tool-call-parser",
                     "hermes", "--reasoning-parser", "qwen3"]) == 0
    assert calls[0][-1] == ChatOutputSettings(True, "hermes", "qwen3")
    assert cli.main(["serve", *model]) == 0
    assert calls[1][-1] == ChatOutputSettings()
    # Refused before the model loads, in one line naming the parsers allowed.
    for flags, words in [(["--tool-call-parser", "mistral"], "--tool-call-parser: unknown tool "
                          "call parser 'mistral' (allowed: hermes, llama3_json)"),
                         (["--enable-auto-tool-choice"], "--enable-auto-tool-choice needs "
                          "--tool-call-parser NAME (allowed: hermes, llama3_json)"),
                         (["--reasoning-parser", "r1"], "--reasoning-parser: unknown "
                          "reasoning parser 'r1' (allowed: qwen3)")]:
        capsys.readouterr()
        assert cli.main(["serve", *model, *flags]) == 2
        assert capsys.readouterr().err == f"myvllm serve: {words}\n"
    assert len(calls) == 2


def test_a_missing_chat_template_is_refused_before_the_model_loads(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    def loading(*_: Any) -> int:
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(cli, "serve", loading)
    missing = tmp_path / "nope.jinja"
    assert cli.main(["serve", "m", "--chat-template", str(missing)]) == 2
    err = capsys.readouterr().err
    assert err == (f"myvllm serve: --chat-template {missing}: no such file; allowed: a "
                   "readable UTF-8 file of a Jinja chat template\n")
    assert cli.main(["serve", "m", "--chat-template", str(tmp_path)]) == 2  # a folder
    assert capsys.readouterr().err.count("\n") == 1


def test_bad_flag_value_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["serve", "some/model", "--block-size", "0"]) == 2
    assert "--block-size 0: allowed: an int >= 1" in capsys.readouterr().err


@pytest.mark.slow  # ~15 s: a whole chat with a real engine (the quick suite stays within 5 minutes)
def test_chat_keeps_the_conversation_and_resets(tiny_path: Path, monkeypatch: Any,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    lines = iter(["hello", "again", "/reset", "third", "/exit"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    seen: list[list[dict[str, str]]] = []
    real_chat_prompt = chat.chat_prompt

    def recording_chat_prompt(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
        seen.append([dict(m) for m in messages])
        return real_chat_prompt(tokenizer, messages)

    monkeypatch.setattr(chat, "chat_prompt", recording_chat_prompt)
    args = argparse.Namespace(temperature=0.0, top_p=1.0, max_tokens=6, seed=None, system=None)
    assert chat.run_chat(Config(model=str(tiny_path), num_kvcache_blocks=64,
                                max_model_length=256), args) == 0
    assert [[m["role"] for m in turn] for turn in seen] == [
        ["user"], ["user", "assistant", "user"], ["user"]]
    first_answer = seen[1][1]["content"]
    assert first_answer and first_answer in capsys.readouterr().out
    assert seen[2] == [{"role": "user", "content": "third"}]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def open_stream(port: int) -> http.client.HTTPResponse:
    """A long streamed completion on 127.0.0.1:port, once its first event has arrived."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    body = {"prompt": "stream", "max_tokens": 200, "ignore_eos": True, "stream": True}
    connection.request("POST", "/v1/completions", json.dumps(body),
                       {"content-type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200
    assert response.readline().startswith(b"data: ")  # it streams
    return response


def is_resource_tracker(pid: int) -> bool:
    """multiprocessing's helper process (spawned with the first child; it exits with us)."""
    try:
        return b"resource_tracker" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def engine_children(pid: int) -> list[int]:
    """The processes pid started for the engine: its engine core, or a core's workers."""
    return [child for child in children_of(pid) if not is_resource_tracker(child)]


def children_of(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue  # ended while we looked
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def descendants(pid: int) -> list[int]:
    """The engine processes below pid, children first then theirs."""
    found = []
    for child in engine_children(pid):
        found += [child, *descendants(child)]
    return found


def health(port: int) -> int | None:
    """/health's status, or None when nothing listens any more."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)
    except (urllib.error.URLError, ConnectionError):
        return None


@contextmanager
def serve_subprocess(args: list[str], port: int,
                     startup_timeout_s: float = 300) -> Iterator[subprocess.Popen[str]]:
    """`myvllm serve ARGS --port PORT` in a subprocess, handed over once /health answers 200
    (within startup_timeout_s); killed afterwards, with any engine process it left behind."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "myvllm.entrypoints.cli", "serve", *args, "--port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + startup_timeout_s
        while health(port) != 200:
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.2)
        yield proc
    finally:
        left = descendants(proc.pid) if proc.poll() is None else []
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in left:  # the core's parent watch ends it; do not wait for that here
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads the process table from /proc")
@pytest.mark.slow  # a `myvllm serve` process started and stopped (~40 s here)
def test_sigterm_aborts_streams_stops_workers_and_exits_0(tiny_path: Path) -> None:
    """SIGTERM mid-stream: the stream ends with "abort" and [DONE], the server exits 0, and
    its engine core and the core's tensor-parallel worker are gone. (Cores of one rank on
    SIGTERM with streams open: test_data_parallel_faults.py, two of them at once.)"""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "myvllm.entrypoints.cli", "serve", str(tiny_path),
         "--port", str(port), "--num-kvcache-blocks", "64", "--tensor-parallel-size", "2",
         "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            assert time.monotonic() < deadline, "the server did not come up"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.2)
        # The engine core process, and the tensor-parallel worker it started.
        (core,) = engine_children(proc.pid)
        workers = [core, *engine_children(core)]
        assert len(workers) == 2, f"tensor_parallel_size 2: expected 1 worker, got {workers}"

        response = open_stream(port)
        proc.send_signal(signal.SIGTERM)
        events = [line.strip() for line in response.read().decode().splitlines() if line]
        assert events[-1] == "data: [DONE]"
        last = json.loads(events[-2].removeprefix("data: "))
        assert last["choices"][0]["finish_reason"] == "abort"

        output = proc.communicate(timeout=60)[0]
        assert proc.returncode == 0, output[-3000:]
        deadline = time.monotonic() + 30
        while any(alive(pid) for pid in workers):
            assert time.monotonic() < deadline, f"left behind: {workers}"
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("command", ["serve", "chat"])
def test_ctrl_c_while_loading_is_one_line_and_leaves_no_process(
        tiny_path: Path, command: str, monkeypatch: Any,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Ctrl-C while the engine core loads: AsyncLLM stops the core it started, and the
    command says so in one line (no traceback) and exits 130, as a shell expects.

    Only the core this command started is looked at: other tests of the same pytest process
    may keep an engine of their own running (the shared server of test_server.py)."""
    from multiprocessing.process import BaseProcess

    from myvllm.serving.async_llm import AsyncLLM

    started: list[BaseProcess] = []

    def interrupted(self: AsyncLLM, ready: Any) -> Any:
        started.append(self._process)  # started by __init__ just before it waits
        raise KeyboardInterrupt

    monkeypatch.setattr(AsyncLLM, "_wait_until_ready", interrupted)
    port = ["--port", str(free_port())] if command == "serve" else []
    assert cli.main([command, str(tiny_path), "--num-kvcache-blocks", "64", *port]) == 130
    err = capsys.readouterr().err
    assert f"myvllm {command}: interrupted while starting" in err
    assert "Traceback" not in err
    (core,) = started
    # shutdown() waited for it (SIGTERM, then SIGKILL: a core still loading reads no message).
    assert core.exitcode is not None, f"the engine core {core.pid} outlived the command"


ENCODED = ["Hello, world!", "  two spaces and a tab\t", "héllo wörld \U0001f600", "1234567890"]


def check_exported_tokenizer(model: str, out: Path) -> None:
    """`myvllm export-tokenizer MODEL OUT` writes what AutoTokenizer loads offline, and
    that tokenizer encodes as the engine's own."""
    assert cli.main(["export-tokenizer", model, str(out)]) == 0
    check_tokenizer_folder(model, out)


def check_tokenizer_folder(model: str, out: Path) -> None:
    """The tokenizer exported to OUT loads offline and encodes as MODEL's engine does.
    (The bundled GGUF's export is checked so in test_lm_eval.py, which exports it anyway.)"""
    from transformers import AutoTokenizer

    from myvllm.engine.startup import tokenizer_if_any

    exported = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    engine = tokenizer_if_any(model)
    for text in ENCODED:
        assert exported.encode(text) == engine.encode(text), text
    assert exported.eos_token_id == engine.eos_token_id
    assert exported.chat_template == engine.chat_template


def test_export_tokenizer_of_a_checkpoint(tiny_path: Path, tmp_path: Path) -> None:
    check_exported_tokenizer(str(tiny_path), tmp_path / "tokenizer")


def test_export_tokenizer_of_a_missing_model_is_an_error(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["export-tokenizer", str(tmp_path / "nothing"), str(tmp_path / "o")]) == 1
    assert "does not exist" in capsys.readouterr().err
