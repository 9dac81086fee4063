"""Checks made before the model loads: by `myvllm serve`, `myvllm chat`, main.py and
main_llama32.py, right after the flags are parsed.

A typo in a flag should cost one line, not a model load (tens of seconds) and a traceback:

    $ myvllm serve --port 99999
    myvllm serve: --port 99999: not a TCP port; allowed: 1..65535
    $ myvllm serve /no/such/model
    myvllm serve: MODEL: model path '/no/such/model' does not exist; allowed: ...

Each refusal is a Refused (a ValueError) whose message names what was wrong and what is
allowed, and refuse() prints it as one line and gives the exit status, 2 (as argparse for a bad
flag). The settings checked: the listening address (the host resolves to an address of this
machine, the port is in range and free), the model and the draft model (found on disk, in the
Hugging Face cache or on the hub), and every Config check, whose messages name the flag
(--block-size) rather than the field (Config.block_size).

Flags argparse does not know are refused by FlagParser, the parser of each subcommand and of
main.py: with that command's usage (a subcommand's, not the top level's) and the closest flag.
"""

from __future__ import annotations

import argparse
import difflib
import errno
import re
import socket
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

from myvllm.config import Config
from myvllm.utils.model_path import resolve_model_path

EXIT_REFUSED = 2  # argparse's status for a bad command line
MODEL_ALLOWED = ("a checkpoint folder (config.json + *.safetensors), a .gguf file or a "
                 "Hugging Face hub id")
HOST_ALLOWED = ("an address of this machine or a name that resolves to one (127.0.0.1, "
                "localhost; 0.0.0.0 or :: for every interface)")
MAX_REASON_CHARS = 300  # a hub error can be long; the line stays readable
T = TypeVar("T")


class FlagParser(argparse.ArgumentParser):
    """An ArgumentParser that refuses arguments it does not know itself, with the closest flag:

        usage: myvllm serve [-h] [--host HOST] ...
        myvllm serve: error: unrecognized arguments: --max-num-seqz (did you mean --max-num-seqs?)

    As a subcommand's parser (add_subparsers(parser_class=FlagParser)) it reports them with
    its own usage; a plain ArgumentParser would hand them up to the top-level parser, whose
    usage says nothing of the subcommand's flags."""

    def parse_known_args(self, args: Iterable[str] | None = None,
                         namespace: Any = None) -> tuple[Any, list[str]]:
        parsed, unknown = super().parse_known_args(args, namespace)
        if unknown:
            self.error(f"unrecognized arguments: {' '.join(unknown)}{self._closest(unknown)}")
        return parsed, unknown

    def _closest(self, unknown: list[str]) -> str:
        flags = [flag for action in self._actions for flag in action.option_strings]
        for arg in unknown:
            if arg.startswith("-"):
                close = difflib.get_close_matches(arg.split("=", 1)[0], flags, n=1)
                if close:
                    return f" (did you mean {close[0]}?)"
        return ""


class Refused(ValueError):
    """A setting refused before the model loads; the message is one line."""


def refuse(prog: str, error: Exception, parser: argparse.ArgumentParser | None = None) -> int:
    """Print error as one line "PROG: message" on stderr (field names as the parser's flags)
    and return the exit status."""
    message = " ".join(str(error).split())  # one line whatever the error held
    if parser is not None:
        message = flag_names(message, parser)
    print(f"{prog}: {message}", file=sys.stderr)
    return EXIT_REFUSED


def flag_names(message: str, parser: argparse.ArgumentParser) -> str:
    """Config.block_size -> --block-size, SamplingParams.max_tokens -> --max-tokens, and a
    value given as Config.block_size=0 as the flag is typed, --block-size 0: the names the user
    typed, where the parser has a flag for the field."""
    flags = {action.dest: action.option_strings[0] for action in parser._actions
             if action.option_strings}

    def rename(match: re.Match[str]) -> str:
        flag = flags.get(match.group(1))
        if flag is None:
            return match.group(0)
        return f"{flag} " if match.group(2) else flag

    return re.sub(r"\b(?:Config|SamplingParams)\.(\w+)(=?)", rename, message)


def checked(make: Callable[[], T]) -> T:
    """make() (a Config, a SamplingParams), its ValueError or TypeError a Refused."""
    try:
        return make()
    except (ValueError, TypeError) as e:
        raise Refused(str(e)) from None


def check_port(port: int) -> None:
    if not 1 <= port <= 65535:
        raise Refused(f"--port {port}: not a TCP port; allowed: 1..65535")


def check_listen_address(host: str, port: int) -> None:
    """host resolves and port can be listened on there, as the server will: every address
    host resolves to bound at once, SO_REUSEADDR set (as asyncio's create_server under
    uvicorn does, so a port left in TIME_WAIT by a stopped server counts as free)."""
    check_port(port)
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                       flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise Refused(f"--host {host}: does not resolve ({e.strerror}); allowed: "
                      f"{HOST_ALLOWED}") from None
    sockets = []
    try:
        for family, kind, proto, _, address in addresses:
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
            except OSError as e:
                raise _bind_refusal(host, port, str(address[0]), e) from None
    finally:
        for sock in sockets:
            sock.close()


def _bind_refusal(host: str, port: int, address: str, error: OSError) -> Refused:
    if error.errno == errno.EADDRINUSE:
        return Refused(f"--port {port}: already in use on {address} (another server runs "
                       f"there?); allowed: a free port (1..65535)")
    if error.errno == errno.EADDRNOTAVAIL:
        return Refused(f"--host {host}: {address} is not an address of this machine; "
                       f"allowed: {HOST_ALLOWED}")
    if error.errno == errno.EACCES:
        return Refused(f"--port {port}: listening on it needs privileges this process does "
                       f"not have; allowed: 1024..65535 (or run with the privilege)")
    return Refused(f"--host {host} --port {port}: cannot listen on {address} "
                   f"({error.strerror}); allowed: {HOST_ALLOWED}, and a free port")


def check_model(model: str | None, what: str, weights: bool = True) -> str:
    """The local path of model (None: the bundled one), or a Refused naming `what` (MODEL,
    --model, --speculative-model). A hub id is fetched here if it is not cached yet, as the
    engine would fetch it first thing; weights=False: no weight files (load_format dummy)."""
    try:
        path = resolve_model_path(model, weights=weights)
        if Path(path).is_dir() and not (Path(path) / "config.json").is_file():
            raise FileNotFoundError(f"no config.json in checkpoint directory {path!r}")
        return path
    except (FileNotFoundError, ValueError) as e:  # ModelNotFoundError is a FileNotFoundError
        reason = " ".join(str(e).split())
        if len(reason) > MAX_REASON_CHARS:
            reason = reason[:MAX_REASON_CHARS] + " ..."
        # The cause stays: main.py runs the bundled model for a hub id it cannot fetch.
        raise Refused(f"{what}: {reason}; allowed: {MODEL_ALLOWED}") from e


def check_device(config: Config) -> None:
    """device "cuda" where torch sees no GPU (torch is imported only then)."""
    if config.device != "cuda":
        return
    import torch

    if not torch.cuda.is_available():
        raise Refused("--device cuda: torch sees no CUDA device here; allowed: auto (a GPU "
                      "when there is one, else the CPU) or cpu")
