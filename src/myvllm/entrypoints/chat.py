"""`myvllm chat`: a conversation in the terminal, the answer printed as it is generated.

One user, one request at a time, so no server and no engine thread: the loop below calls
LLMEngine.step_outputs() itself and prints each step's new text (IncrementalDetokenizer makes
it right across multi-byte characters). The conversation is kept as a list of messages and
the whole of it goes through the chat template at every turn; the prefix cache finds the
earlier turns' blocks, so only the new message and the answer are computed.

    /reset   start a new conversation        /exit (or Ctrl-D)   quit
    Ctrl-C while the answer streams: stop it (the partial answer stays in the conversation)
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

from myvllm.config import Config
from myvllm.engine.detokenizer import IncrementalDetokenizer
from myvllm.sampling_parameters import SamplingParams

HELP = "/reset starts a new conversation, /exit (or Ctrl-D) quits, Ctrl-C stops an answer."


def stream_reply(engine: Any, prompt_ids: list[int], params: SamplingParams,
                 interrupted: threading.Event) -> Iterator[str]:
    """Generate one answer; yield its text as it comes. Stops early when `interrupted` is set
    (checked between steps, so a step is never cut in half) and then aborts the request."""
    detok = IncrementalDetokenizer(engine.tokenizer, prompt_ids)
    request_id = engine.add_request(prompt_ids, params)
    finished = False
    try:
        while not finished and not interrupted.is_set():
            outputs, _ = engine.step_outputs()
            for out in outputs:
                if out.request_id != request_id:
                    continue
                text = detok.add_tokens(out.new_token_ids)
                if out.finished:
                    text += detok.finish()
                    finished = True
                if text:
                    yield text
    finally:
        if not finished:
            engine.abort(request_id)


def chat_prompt(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    # enable_thinking=False: Qwen3 answers directly instead of reasoning at length first
    # (templates that do not know the flag ignore it).
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                         enable_thinking=False)
    return list(tokenizer.encode(text, add_special_tokens=False))


def run_chat(config: Config, args: argparse.Namespace) -> int:
    from myvllm.engine.llm_engine import LLMEngine

    params = SamplingParams(temperature=args.temperature, top_p=args.top_p,
                            max_tokens=args.max_tokens, seed=args.seed)
    engine = LLMEngine(config)
    try:
        tokenizer = engine.tokenizer
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            print(f"myvllm chat: {engine.model_path} has no chat template", file=sys.stderr)
            return 2
        start = [{"role": "system", "content": args.system}] if args.system else []
        messages = list(start)
        print(HELP)
        while True:
            try:
                line = input("> ").strip()
            except (EOFError, KeyboardInterrupt):
                print()
                return 0
            if line in ("/exit", "/quit"):
                return 0
            if line == "/reset":
                messages = list(start)
                print("(new conversation)")
                continue
            if not line:
                continue
            messages.append({"role": "user", "content": line})
            prompt_ids = chat_prompt(tokenizer, messages)
            if len(prompt_ids) >= engine.config.max_model_length:
                messages.pop()
                print(f"(the conversation would be {len(prompt_ids)} tokens, the model takes "
                      f"{engine.config.max_model_length}: /reset to start over)")
                continue
            answer = answer_turn(engine, prompt_ids, params)
            messages.append({"role": "assistant", "content": answer})
    finally:
        engine.exit()


def answer_turn(engine: Any, prompt_ids: list[int], params: SamplingParams) -> str:
    """Print the answer as it streams; Ctrl-C stops it between two steps."""
    interrupted = threading.Event()
    previous = signal.signal(signal.SIGINT, lambda *_: interrupted.set())
    parts = []
    try:
        for text in stream_reply(engine, prompt_ids, params, interrupted):
            print(text, end="", flush=True)
            parts.append(text)
    finally:
        signal.signal(signal.SIGINT, previous)
    print(" [stopped]" if interrupted.is_set() else "")
    return "".join(parts)
