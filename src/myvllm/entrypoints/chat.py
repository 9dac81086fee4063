"""`myvllm chat`: a conversation in the terminal, the answer printed as it is generated.

The engine core runs in its own process, as under `myvllm serve`: this process is AsyncLLM's
front end (tokenizer, chat template, detokenizer) and prints each output's new text as it
arrives. One event loop lives for the whole chat and runs while an answer streams; between
turns it rests, and the core, with nothing to do, waits for the next request.

The conversation is kept as a list of messages and the whole of it goes through the chat
template at every turn; the prefix cache finds the earlier turns' blocks, so only the new
message and the answer are computed.

    /reset   start a new conversation        /exit (or Ctrl-D)   quit
    Ctrl-C while the answer streams: stop it (the partial answer stays in the conversation)
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import signal
import sys
import threading
from collections.abc import AsyncIterator
from typing import Any

from myvllm.config import Config
from myvllm.sampling_parameters import SamplingParams
from myvllm.utils.chat_template import chat_prompt_ids

HELP = "/reset starts a new conversation, /exit (or Ctrl-D) quits, Ctrl-C stops an answer."


async def stream_reply(llm: Any, prompt_ids: list[int], params: SamplingParams,
                       interrupted: threading.Event) -> AsyncIterator[str]:
    """Generate one answer; yield its text as it comes. Stops early when `interrupted` is set
    (checked at every output) and then aborts the request."""
    outputs = llm.generate(prompt_ids, params)
    try:
        async for out in outputs:
            if out.text:
                yield out.text
            if interrupted.is_set():
                return
    finally:
        await outputs.aclose()  # leaving early aborts the request in the core


def chat_prompt(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    # enable_thinking=False: Qwen3 answers directly instead of reasoning at length first
    # (templates that do not know the flag ignore it).
    return chat_prompt_ids(tokenizer, messages, template_kwargs={"enable_thinking": False})


def chat_sampling_params(args: argparse.Namespace) -> SamplingParams:
    """The flags' sampling settings (bad values raise ValueError, before the model loads)."""
    return SamplingParams(temperature=args.temperature, top_p=args.top_p,
                          max_tokens=args.max_tokens, seed=args.seed)


def run_chat(config: Config, args: argparse.Namespace) -> int:
    from myvllm.serving.async_llm import AsyncLLM

    params = chat_sampling_params(args)
    try:
        llm = AsyncLLM(config)
    except ValueError as e:  # settings the checkpoint refuses (its heads, its architecture)
        print(f"myvllm chat: {e}", file=sys.stderr)
        return 2
    loop = asyncio.new_event_loop()
    try:
        tokenizer = llm.tokenizer
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            print(f"myvllm chat: {llm.model_path} has no chat template", file=sys.stderr)
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
            if len(prompt_ids) >= llm.max_model_length:
                messages.pop()
                print(f"(the conversation would be {len(prompt_ids)} tokens, the model takes "
                      f"{llm.max_model_length}: /reset to start over)")
                continue
            # --max-tokens, or what is left of the context when that is less (a request
            # asking for more than fits is refused).
            turn = dataclasses.replace(params, max_tokens=min(
                params.max_tokens, llm.max_model_length - len(prompt_ids)))
            answer = loop.run_until_complete(answer_turn(llm, prompt_ids, turn))
            messages.append({"role": "assistant", "content": answer})
    finally:
        llm.shutdown()
        loop.close()


async def answer_turn(llm: Any, prompt_ids: list[int], params: SamplingParams) -> str:
    """Print the answer as it streams; Ctrl-C stops it."""
    interrupted = threading.Event()
    previous = signal.signal(signal.SIGINT, lambda *_: interrupted.set())
    parts = []
    try:
        async for text in stream_reply(llm, prompt_ids, params, interrupted):
            print(text, end="", flush=True)
            parts.append(text)
    finally:
        signal.signal(signal.SIGINT, previous)
    print(" [stopped]" if interrupted.is_set() else "")
    return "".join(parts)
