"""The command line behind main.py and main_llama32.py (one implementation, two defaults)."""

from __future__ import annotations

import argparse
import time

# Questions that the bundled 135M model answers right too (it answers "List three prime
# numbers." with "1. 1"): the demo shows the engine at work, not what a small model knows.
DEFAULT_PROMPTS = [
    "What is the capital of France?",
    "Name three colors.",
    "Write one sentence about the sea.",
]


def build_parser(default_model: str) -> argparse.ArgumentParser:
    from myvllm.entrypoints.preflight import FlagParser  # an unknown flag: the closest one

    parser = FlagParser(
        description="Generate chat completions with myvllm. When the model is neither on disk "
                    "nor in the local Hugging Face cache and the hub cannot be reached, the "
                    "bundled SmolLM2-135M-Instruct (GGUF) runs instead.")
    parser.add_argument("--model", default=default_model,
                        help="hub id, local checkpoint dir or .gguf file (default: %(default)s)")
    parser.add_argument("--prompt", action="append", dest="prompts", metavar="TEXT",
                        help="a user message (repeat for several; default: three examples)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--seed", type=int, default=None,
                        help="random seed of every request, so a run with --temperature > 0 "
                             "can be repeated (default: a new draw each run)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--enforce-eager", action="store_true",
                        help="no CUDA graphs (always the case on a CPU)")
    return parser


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def run_demo(default_model: str, argv: list[str] | None = None) -> None:
    parser = build_parser(default_model)
    args = parser.parse_args(argv)
    from myvllm import Config, SamplingParams
    from myvllm.entrypoints.preflight import Refused, check_model, checked, refuse
    from myvllm.utils.model_path import ModelNotFoundError

    try:  # bad values stop here, before seconds of imports and model loading
        params = checked(lambda: SamplingParams(temperature=args.temperature,
                                                max_tokens=args.max_tokens, seed=args.seed))
        config = checked(lambda: Config(model=args.model,
                                        tensor_parallel_size=args.tensor_parallel_size,
                                        enforce_eager=args.enforce_eager))
        try:
            check_model(config.model, "--model")
        except Refused as e:
            if not isinstance(e.__cause__, ModelNotFoundError) or config.model is None:
                raise  # a local path that does not exist, a file that is no checkpoint
            # A hub id that is neither cached nor reachable: the bundled model runs. One
            # line, with the hub's own reason (offline, gated repo, unknown id ...).
            reason = str(e.__cause__.__cause__ or e).strip().splitlines()[0][:160]
            print(f"{config.model} is not in the local cache and could not be fetched "
                  f"({reason}): running the bundled SmolLM2-135M-Instruct instead (a "
                  "135M-parameter model: fluent, but often wrong on facts and arithmetic).")
            config.model = None
            check_model(None, "--model")
    except Refused as e:
        raise SystemExit(refuse(parser.prog, e, parser)) from None
    from myvllm import LLM

    try:
        llm = LLM(config)
    except ValueError as e:  # what the checkpoint refuses (its heads, its architecture),
        raise SystemExit(refuse(parser.prog, e, parser)) from None  # before any weight
    prompts = args.prompts or DEFAULT_PROMPTS
    chats = [
        llm.tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                          add_generation_prompt=True, enable_thinking=False)
        for p in prompts
    ]
    start = time.perf_counter()
    outputs = llm.generate(chats, params)
    elapsed = time.perf_counter() - start
    for prompt, out in zip(prompts, outputs):
        print(f"\nPrompt: {prompt!r}\nCompletion: {out['text']!r}")
    num_tokens = sum(len(out["token_ids"]) for out in outputs)
    print(f"\n{plural(len(outputs), 'prompt')}, {plural(num_tokens, 'completion token')} in "
          f"{elapsed:.2f} s ({num_tokens / elapsed:.1f} tok/s) on {llm.model_runner.device.type}")
    llm.exit()
