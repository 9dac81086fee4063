"""What `myvllm serve`, `myvllm chat` and main.py refuse before the model loads: one line on
stderr naming what was wrong and what is allowed, exit status 2, no traceback, no load."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from myvllm.entrypoints import chat, cli

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def no_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    """A refusal must come before the engine starts: starting it fails the test."""
    def loading(*_: Any) -> int:
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(cli, "serve", loading)
    monkeypatch.setattr(chat, "run_chat", loading)


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """A checkpoint folder as far as the checks before loading look (its config.json)."""
    (tmp_path / "config.json").write_text("{}")
    return tmp_path


def refusal(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """cli.main(argv)'s one line on stderr, once it exited 2."""
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"myvllm {argv[0]}: ")
    return err


@pytest.mark.parametrize(("flags", "words"), [
    (["--port", "-5"], ["--port -5", "allowed: 1..65535"]),
    (["--port", "70000"], ["--port 70000", "allowed: 1..65535"]),
    (["--host", "no-such-host.invalid"], ["--host no-such-host.invalid", "does not resolve",
                                          "allowed: an address of this machine"]),
    (["--host", "192.0.2.1"], ["192.0.2.1 is not an address of this machine", "allowed:"]),
    (["--block-size", "0"], ["--block-size 0: allowed: an int >= 1"]),
    (["--max-num-seqs", "0"], ["--max-num-sequences 0: allowed: an int >= 1"]),
    (["--dtype", "fp7"], ["--dtype 'fp7': allowed: 'auto', 'float16', 'bfloat16', 'float32'"]),
    (["--speculative-method", "draft"], ["--speculative-method 'draft' needs "
                                         "--speculative-model, the draft model (given None); "
                                         "allowed: a checkpoint folder"]),
    (["--speculative-method", "draft", "--speculative-model", "/no/such/draft"],
     ["--speculative-model: model path '/no/such/draft' does not exist", "allowed: a "
      "checkpoint folder"]),
])
def test_serve_refuses_a_bad_setting_before_loading(
        flags: list[str], words: list[str], model_dir: Path, no_loading: None,
        capsys: pytest.CaptureFixture[str]) -> None:
    port = [] if "--port" in flags else ["--port", str(free_port())]
    err = refusal(["serve", str(model_dir), *port, *flags], capsys)
    for word in words:
        assert word in err


@pytest.mark.parametrize("command", ["serve", "chat"])
def test_a_model_that_does_not_exist_is_one_line(command: str, tmp_path: Path,
                                                 no_loading: None,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "no" / "model"
    port = ["--port", str(free_port())] if command == "serve" else []
    err = refusal([command, str(missing), *port], capsys)
    assert f"MODEL: model path '{missing}' does not exist" in err
    assert "allowed: a checkpoint folder (config.json + *.safetensors), a .gguf file" in err
    missing.mkdir(parents=True)  # a folder, but no checkpoint
    err = refusal([command, str(missing), *port], capsys)
    assert f"MODEL: no config.json in checkpoint directory '{missing}'; allowed: " in err


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield int(sock.getsockname()[1])


def test_a_busy_port_is_one_line(busy_port: int, model_dir: Path, no_loading: None,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    err = refusal(["serve", str(model_dir), "--port", str(busy_port)], capsys)
    assert f"--port {busy_port}: already in use on 127.0.0.1" in err
    assert "allowed: a free port" in err


def test_chat_refuses_its_sampling_flags_and_replicas(model_dir: Path, no_loading: None,
                                                      capsys: pytest.CaptureFixture[str]
                                                      ) -> None:
    err = refusal(["chat", str(model_dir), "--temperature", "-1"], capsys)
    assert "--temperature -1.0: allowed: a finite number >= 0" in err
    err = refusal(["chat", str(model_dir), "--max-tokens", "0"], capsys)
    assert "--max-tokens 0: allowed: an int >= 1" in err
    err = refusal(["chat", str(model_dir), "--data-parallel-size", "2"], capsys)
    assert "--data-parallel-size 2 is for `myvllm serve`" in err and "allowed: 1" in err


def test_device_cuda_without_a_gpu_is_one_line(model_dir: Path, no_loading: None,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    err = refusal(["chat", str(model_dir), "--device", "cuda"], capsys)
    assert "--device cuda: torch sees no CUDA device here; allowed: auto" in err


def run_script(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


def test_the_commands_refuse_in_one_line() -> None:
    """The real entry points, in their own processes: the exit status and stderr as a shell
    sees them."""
    done = run_script("-m", "myvllm.entrypoints.cli", "serve", "--port", "-5")
    assert (done.returncode, done.stderr) == (
        2, "myvllm serve: --port -5: not a TCP port; allowed: 1..65535\n")
    done = run_script("main.py", "--model", "/no/such/model")
    assert done.returncode == 2
    assert done.stderr == ("main.py: --model: model path '/no/such/model' does not exist; "
                           "allowed: a checkpoint folder (config.json + *.safetensors), a "
                           ".gguf file or a Hugging Face hub id\n")
    done = run_script("main_llama32.py", "--max-tokens", "0", "--tensor-parallel-size", "1")
    assert (done.returncode, done.stderr) == (
        2, "main_llama32.py: --max-tokens 0: allowed: an int >= 1 (the most completion "
           "tokens to generate)\n")


@pytest.mark.parametrize(("argv", "words"), [
    (["serve", "--max-num-seqz", "8"], ["usage: myvllm serve", "myvllm serve: error: "
                                        "unrecognized arguments: --max-num-seqz",
                                        "(did you mean --max-num-seqs?)"]),
    (["chat", "--temprature=0.5"], ["usage: myvllm chat", "unrecognized arguments: "
                                    "--temprature=0.5 (did you mean --temperature?)"]),
    (["serve", "--port", "abc"], ["usage: myvllm serve",
                                  "argument --port: invalid int value: 'abc'"]),
])
def test_an_unknown_flag_prints_the_subcommands_usage_and_the_closest_flag(
        argv: list[str], words: list[str], no_loading: None,
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    for word in words:
        assert word in err
    assert "{serve,chat,export-tokenizer}" not in err  # not the top level's usage


def test_main_py_suggests_the_closest_flag(capsys: pytest.CaptureFixture[str]) -> None:
    from myvllm.demo import run_demo

    with pytest.raises(SystemExit) as exited:
        run_demo("some/model", ["--promt", "hi"])
    assert exited.value.code == 2
    assert "unrecognized arguments: --promt hi (did you mean --prompt?)" in (
        capsys.readouterr().err)


def test_main_py_refuses_what_the_checkpoint_refuses_in_one_line(tmp_path: Path) -> None:
    """Once the checkpoint's config is read, still before any weight: heads that do not split
    over --tensor-parallel-size."""
    from helpers_models import build_tiny_checkpoint

    path = build_tiny_checkpoint("qwen3", tmp_path / "tiny")  # 4 heads, 2 kv heads
    done = run_script("main.py", "--model", str(path), "--tensor-parallel-size", "3")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    (line,) = done.stderr.splitlines()[-1:]
    assert line.startswith("main.py: tensor_parallel_size=3 must divide both")
