"""The `myvllm` command.

    myvllm serve [MODEL] [--host H] [--port P] [--max-model-length 2048 ...]
                 [--api-key KEY] [--chat-template FILE]
                 [--enable-auto-tool-choice --tool-call-parser NAME] [--reasoning-parser NAME]
    myvllm chat  [MODEL] [--max-tokens N] [--temperature T] [--system TEXT] [...]
    myvllm export-tokenizer [MODEL] OUT_DIR

Every Config field is a flag of both subcommands, its name in kebab-case (max_model_length ->
--max-model-length, booleans as --enforce-eager / --no-enforce-eager), with the field's own
docstring as its help; vLLM's names of two of them are aliases (--max-num-seqs,
--max-model-len: CONFIG_FLAG_ALIASES). A flag that is not given leaves the Config default in
place, so the defaults live in one place (config.py).

Under torchrun (one process per tensor-parallel rank, on one host or several) the same command
runs on every rank: rank 0 serves or chats, the other ranks serve rank 0's calls until it
exits (docs/serving.md, "Several hosts").

MODEL defaults to Qwen/Qwen3-0.6B, as main.py. When it is neither on disk nor in the local
Hugging Face cache and the hub cannot be reached, one line says so and the bundled
SmolLM2-135M-Instruct runs instead. A MODEL named on the command line that cannot be found is
an error: a server quietly serving another model would be worse.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import os
import sys
import types
import typing
from typing import TYPE_CHECKING, Any

from myvllm.config import Config
from myvllm.entrypoints.preflight import FlagParser
from myvllm.entrypoints.safeguards.server_limits import add_server_limit_flags, server_limits

if TYPE_CHECKING:
    from myvllm.entrypoints.chat_output_parsing import ChatOutputSettings
    from myvllm.entrypoints.safeguards.server_limits import ServerLimits
    from myvllm.utils.distributed import TorchrunEnv

DEFAULT_MODEL = "Qwen/Qwen3-0.6B"
# vLLM's flag names beside ours, for the commands vLLM users type.
CONFIG_FLAG_ALIASES = {"max_num_sequences": ["--max-num-seqs"],
                       "max_model_length": ["--max-model-len"]}
API_KEY_ENV = "MYVLLM_API_KEY"
BUNDLED_MODEL_NAME = "SmolLM2-135M-Instruct"


def _field_docs() -> dict[str, str]:
    """Config's attribute docstrings (the string under each field), for --help."""
    tree = ast.parse(inspect.getsource(Config))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            docs[node.target.id] = " ".join(after.value.value.split()).replace("%", "%%")
    return docs


def _int_list(text: str) -> int | tuple[int, ...]:
    """"2" -> 2, "2,7" -> (2, 7): the eos flag's one id or several."""
    try:
        ids = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: allowed: a token id or comma-separated "
                                         "token ids (2, or 2,7)") from None
    return ids[0] if len(ids) == 1 else ids


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per Config field except model (the positional MODEL)."""
    hints = typing.get_type_hints(Config)
    docs = _field_docs()
    group = parser.add_argument_group("engine (Config fields)")
    for field in dataclasses.fields(Config):
        if field.name == "model":
            continue
        flags = ["--" + field.name.replace("_", "-"), *CONFIG_FLAG_ALIASES.get(field.name, [])]
        kind = hints[field.name]
        args = typing.get_args(kind)
        if isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union:
            concrete = [a for a in args if a is not type(None)]
            kind = concrete[0] if len(concrete) == 1 else None
        help_text = f"{docs.get(field.name, '')} (default: {field.default!r})"
        options: dict[str, Any] = {"dest": field.name, "default": argparse.SUPPRESS,
                                   "help": help_text}
        if kind is bool:
            group.add_argument(*flags, action=argparse.BooleanOptionalAction, **options)
        elif kind in (int, float, str):
            group.add_argument(*flags, type=kind, metavar=field.name.upper(), **options)
        else:  # eos: an id or several
            group.add_argument(*flags, type=_int_list, metavar="ID[,ID...]", **options)


def add_model_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None, metavar="MODEL",
                        help=f"hub id, local checkpoint dir or .gguf file (default: "
                             f"{DEFAULT_MODEL}, or the bundled {BUNDLED_MODEL_NAME} when "
                             "that cannot be found)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="myvllm", description="myvllm: serve or chat with "
                                     "a model.")
    # Each subcommand refuses the flags it does not know, with its usage and the closest flag.
    sub = parser.add_subparsers(dest="command", required=True, parser_class=FlagParser)

    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server",
                           description="Serve MODEL over an OpenAI-compatible HTTP API: "
                           "/v1/completions, /v1/chat/completions, /v1/models, /health, "
                           "/metrics, /ping, /version.")
    add_model_argument(serve)
    serve.add_argument("--host", default="127.0.0.1",
                       help="address to listen on; 0.0.0.0 for every interface "
                            "(default: %(default)s)")
    serve.add_argument("--port", type=int, default=8000, help="(default: %(default)s)")
    serve.add_argument("--served-model-name", default=None,
                       help="the name clients put in 'model' (default: MODEL as given)")
    serve.add_argument("--log-level", default="info",
                       choices=["critical", "error", "warning", "info", "debug"])
    serve.add_argument("--data-parallel-routing", default="prefix",
                       choices=["prefix", "least_loaded", "round_robin"],
                       help="with --data-parallel-size > 1, how a request picks its replica: "
                            "by prompt prefix (prefix-cache hits stay on one replica), else "
                            "the least loaded; or by load alone; or in turn (default: "
                            "%(default)s)")
    serve.add_argument("--api-key", default=os.environ.get(API_KEY_ENV), metavar="KEY",
                       help="answer 401 to requests without 'Authorization: Bearer KEY' "
                            "(/health, /ping, /metrics and /version stay open); default: "
                            f"the {API_KEY_ENV} environment variable, else no key")
    serve.add_argument("--chat-template", default=None, metavar="FILE",
                       help="a Jinja chat template used for chat requests instead of the "
                            "tokenizer's own")
    add_chat_output_flags(serve)
    add_server_limit_flags(serve)
    add_config_flags(serve)

    chat = sub.add_parser("chat", help="an interactive chat in the terminal",
                          description="Chat with MODEL in the terminal; the answer streams. "
                          "/reset starts a new conversation, /exit (or Ctrl-D) quits.")
    add_model_argument(chat)
    chat.add_argument("--max-tokens", type=int, default=1024,
                      help="most tokens per answer (default: %(default)s)")
    chat.add_argument("--temperature", type=float, default=0.7,
                      help="0 = greedy (default: %(default)s)")
    chat.add_argument("--top-p", type=float, default=0.9, help="(default: %(default)s)")
    chat.add_argument("--seed", type=int, default=None)
    chat.add_argument("--system", default=None, metavar="TEXT",
                      help="a system message opening every conversation")
    add_config_flags(chat)

    export = sub.add_parser(
        "export-tokenizer", help="write the model's tokenizer to a folder",
        description="Write the tokenizer that `myvllm serve MODEL` uses (for a .gguf file, "
        "such as the bundled model, the one in its metadata) to OUT_DIR, from where "
        "transformers' AutoTokenizer.from_pretrained(OUT_DIR) loads it offline: for clients "
        "that count or build tokens on their side (lm-evaluation-harness, guidellm).")
    add_model_argument(export)
    export.add_argument("out_dir", metavar="OUT_DIR", help="created if missing")
    return parser


def add_chat_output_flags(parser: argparse.ArgumentParser) -> None:
    """vLLM's flags that read chat answers as tool calls and reasoning."""
    from myvllm.entrypoints.reasoning_parsers import ReasoningParserManager
    from myvllm.entrypoints.tool_parsers import ToolParserManager

    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help='let the model decide when to call tools (tool_choice "auto", '
                             "the default of a request with tools); needs --tool-call-parser")
    parser.add_argument("--tool-call-parser", default=None, metavar="NAME",
                        help="how the model writes tool calls: "
                             f"{ToolParserManager.names()} (hermes: "
                             "Qwen3's and Hermes' <tool_call>; llama3_json: Llama 3's JSON)")
    parser.add_argument("--reasoning-parser", default=None, metavar="NAME",
                        help="split the model's thinking into reasoning_content: "
                             f"{ReasoningParserManager.names()}")


def chat_output_settings(args: argparse.Namespace) -> ChatOutputSettings:
    """The serve flags of add_chat_output_flags, checked (ValueError: an unknown parser)."""
    from myvllm.entrypoints.chat_output_parsing import ChatOutputSettings

    settings = ChatOutputSettings(args.enable_auto_tool_choice, args.tool_call_parser,
                                  args.reasoning_parser)
    settings.check()
    return settings


def pick_model(model: str | None) -> tuple[str | None, str]:
    """(the Config.model to load, the name to show). None loads the bundled model."""
    if model is not None:
        return model, model
    from myvllm.utils.model_path import ModelNotFoundError, resolve_model_path

    try:
        resolve_model_path(DEFAULT_MODEL)
    except ModelNotFoundError as e:
        # One line, with the hub's own reason (offline, gated repo, unknown id ...).
        reason = str(e.__cause__ or e).strip().splitlines()[0][:160]
        print(f"{DEFAULT_MODEL} is not in the local cache and could not be fetched ({reason}): "
              f"running the bundled {BUNDLED_MODEL_NAME} instead.", file=sys.stderr)
        return None, BUNDLED_MODEL_NAME
    return DEFAULT_MODEL, DEFAULT_MODEL


def engine_config(args: argparse.Namespace) -> Config:
    fields = {name: getattr(args, name) for name in Config.field_names()
              if name != "model" and hasattr(args, name)}
    return Config(model=args.model, **fields)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from myvllm.entrypoints.preflight import refuse
    from myvllm.utils.distributed import check_torchrun_world_size, torchrun_env

    try:
        config = engine_config(args)
        chat_template = read_chat_template(getattr(args, "chat_template", None))
        chat_outputs = chat_output_settings(args) if args.command == "serve" else None
        limits = server_limits(args) if args.command == "serve" else None
        launch = torchrun_env()
        check_torchrun_world_size(launch, config.tensor_parallel_size)
        loads_here = args.command != "export-tokenizer" and (launch is None or launch.rank == 0)
        if loads_here:
            check_settings(args, config)
        # After the quick checks: finding the default model may ask the hub.
        args.model, name = pick_model(args.model)
        config = dataclasses.replace(config, model=args.model)
        if loads_here:
            check_models(config)
    except (ValueError, TypeError) as e:  # one line, exit status 2 (preflight.py)
        return refuse(f"myvllm {args.command}", e, command_parser(parser, args.command))
    try:
        if launch is not None and launch.rank != 0 and args.command != "export-tokenizer":
            return serve_rank_0_calls(config, launch)
        if args.command == "export-tokenizer":
            return export_tokenizer(args.model, args.out_dir)
        if args.command == "serve":
            return serve(config, args.served_model_name or name, args.host, args.port,
                         args.log_level, args.data_parallel_routing, args.api_key or None,
                         chat_template, chat_outputs, limits=limits)
        from myvllm.entrypoints.chat import run_chat

        return run_chat(config, args)
    except KeyboardInterrupt:  # Ctrl-C while the model loads (later, each command handles it)
        print(f"myvllm {args.command}: interrupted while starting", file=sys.stderr)
        return 130


def command_parser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    """The subcommand's own parser (its flags, its usage)."""
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return subparsers.choices[command]


def check_settings(args: argparse.Namespace, config: Config) -> None:
    """The quick checks before the model loads (preflight.py): serve's address, chat's
    sampling flags and replicas, the device."""
    from myvllm.entrypoints import preflight

    if args.command == "serve":
        preflight.check_listen_address(args.host, args.port)
    else:
        from myvllm.entrypoints.chat import chat_sampling_params

        preflight.checked(lambda: chat_sampling_params(args))
        if config.data_parallel_size != 1:
            raise preflight.Refused(
                f"--data-parallel-size {config.data_parallel_size} is for `myvllm serve`: one "
                "conversation runs on one engine; allowed: 1")
    preflight.check_device(config)


def check_models(config: Config) -> None:
    """The model and the draft model found (a hub id is fetched, as loading would first)."""
    from myvllm.entrypoints.preflight import check_model

    check_model(config.model, "MODEL", weights=config.load_format != "dummy")
    if config.speculative_model is not None:
        check_model(config.speculative_model, "--speculative-model")


TEMPLATE_ALLOWED = "a readable UTF-8 file of a Jinja chat template"


def read_chat_template(path: str | None) -> str | None:
    """--chat-template's file, read before the model loads (ValueError: cannot be read)."""
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        raise ValueError(f"--chat-template {path}: no such file; allowed: {TEMPLATE_ALLOWED}"
                         ) from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--chat-template {path}: cannot be read ({e}); allowed: "
                         f"{TEMPLATE_ALLOWED}") from None


def serve_rank_0_calls(config: Config, launch: TorchrunEnv) -> int:
    """Ranks 1..N-1 of a torchrun launch: this rank's shard of rank 0's engine, until rank 0
    exits; no server and no chat here."""
    from myvllm.executor.tp_workers import run_launched_worker
    from myvllm.utils.device import resolve_device
    from myvllm.utils.model_path import resolve_model_path

    model_path = resolve_model_path(config.model)  # the same model, found on this host
    use_cuda = resolve_device(config).type == "cuda"
    return run_launched_worker(config, launch, model_path, use_cuda)


def export_tokenizer(model: str | None, out_dir: str) -> int:
    """Save MODEL's tokenizer with save_pretrained (tokenizer.json, its config, the chat
    template): a GGUF file's tokenizer lives in its metadata, which only transformers' GGUF
    reader (and this engine) can read, so clients could not load it by themselves."""
    from myvllm.engine.startup import tokenizer_if_any
    from myvllm.utils.model_path import resolve_model_path

    try:
        path = resolve_model_path(model, weights=False)  # a hub id: no weights fetched
    except (FileNotFoundError, ValueError) as e:
        print(f"myvllm export-tokenizer: {e}", file=sys.stderr)
        return 1
    tokenizer = tokenizer_if_any(path)
    if tokenizer is None:
        print(f"myvllm export-tokenizer: {path} has no tokenizer (it takes token ids only)",
              file=sys.stderr)
        return 1
    tokenizer.save_pretrained(out_dir)
    print(f"the tokenizer of {path} is in {out_dir}: AutoTokenizer.from_pretrained"
          f"({out_dir!r}) loads it")
    return 0


def serve(config: Config, model_name: str, host: str, port: int, log_level: str,
          data_parallel_routing: str = "prefix", api_key: str | None = None,
          chat_template: str | None = None,
          chat_outputs: ChatOutputSettings | None = None,
          limits: ServerLimits | None = None) -> int:
    """Run the server until a signal (exit 0) or an engine core's death (exit 1). api_key,
    chat_template, chat_outputs, limits: as openai_server.build_app."""
    from myvllm.serving.async_llm import AsyncLLM
    from myvllm.serving.dp_async_llm import DPAsyncLLM
    from myvllm.serving.engine_client import EngineClient
    from myvllm.entrypoints.openai_server import make_server

    llm: EngineClient
    try:
        # The engine core process(es) start here, and are ready on return.
        if config.data_parallel_size > 1:
            llm = DPAsyncLLM(config, routing=data_parallel_routing)
        else:
            llm = AsyncLLM(config)
    except ValueError as e:  # settings that cannot work here (e.g. more GPUs than visible)
        print(f"myvllm serve: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # the core's own error (its traceback included), not ours
        print(f"myvllm serve: {e}", file=sys.stderr)
        return 1
    server = make_server(llm, model_name, host, port, log_level, api_key=api_key,
                         chat_template=chat_template, chat_outputs=chat_outputs,
                         limits=limits)
    try:
        server.run()
    finally:
        llm.shutdown()  # the core process(es), and with them any tensor-parallel workers
    return 0 if server.started and not server.core_died else 1


if __name__ == "__main__":  # tensor-parallel workers are spawned processes
    sys.exit(main())
