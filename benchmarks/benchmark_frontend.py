"""Host CPU a served token costs: the front end and the engine core process, without a GPU.

    uv run python benchmarks/benchmark_frontend.py                 # 256 streams, fake steps
    uv run python benchmarks/benchmark_frontend.py --profile front # where the front end's time goes
    uv run python benchmarks/benchmark_frontend.py --profile core  # and the core process's
    uv run python benchmarks/benchmark_frontend.py --quick         # a small CPU smoke run (CI)

What runs: the real server (`make_server`: uvicorn, FastAPI, the completions route, AsyncLLM)
in this process, and the real engine core process (EngineCoreProc's busy loop, the
Scheduler, the BlockManager, the messages between them), on a tiny Qwen3 of dummy weights
whose model runner is replaced by a fake step: every row gets token FAKE_TOKEN_ID at once,
after --step-ms of sleep (a GPU's step time, which costs the host nothing). The clients
(benchmarks/benchmark_serving.py's, --client) run in a process of their own (or
--client-processes of them), so that their Python is not counted in the server's; their CPU
time is printed beside it. The workload is benchmark_serving.py's: --num-prompts requests at
once, streamed, prompt and output lengths uniform in 100..1024, ignore_eos.

First the admission: every request at once for one token, the front end's CPU time a
request (HTTP, parsing, the checks, AddRequest, one event), and the clients' (a request's
way out and its one event: all of them leave one client process in turn, so this sets how
far apart the requests arrive). Then the workload (after a
warm-up), measured: the CPU time of this process (the front end:
HTTP, JSON, server-sent events, AsyncLLM; time.process_time) and of the core process (from
/proc), each per output token and per server-sent event, and how many tokens an event
carried on average (1.0: the front end kept up with every step; more: it fell behind and sent
several steps' tokens in one event). The prompts are token ids and the model has no
tokenizer, as in benchmark_serving.py's workload, so no text is detokenized.

--profile front|core runs cProfile (counting CPU time) in that process during the workload
(the front end: the admission too; the core: its whole busy loop) and prints the functions taking the most time (their own time, then cumulative). Figures are host CPU
figures of the machine that runs it; a GPU's serving speed is benchmark_serving.py's.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import functools
import io
import json
import math
import multiprocessing as mp
import os
import pstats
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "src")]  # benchmarks.* and myvllm, run as a file too

FAKE_TOKEN_ID = 7
VOCAB_SIZE = 512  # the tiny Qwen3's


def tiny_model_dir(out: Path) -> Path:
    """config.json of the tiny Qwen3 of benchmarks/workload.py, with room for the bench
    workload's 2,048 tokens a sequence (weights: dummy, made in the core)."""
    from benchmarks.workload import tiny_qwen3_config

    hf_config = tiny_qwen3_config()
    hf_config.max_position_embeddings = 4096
    hf_config.save_pretrained(str(out))
    return out


class FakeStep:
    """ModelRunner.run's stand-in: a token for every row at once, after step_s of sleep."""

    def __init__(self, step_s: float) -> None:
        self.step_s = step_s

    def __call__(self, seqs: list[Any], is_prefill: bool) -> Any:
        import torch

        from myvllm.worker.staging import SampledTokens

        if self.step_s:
            time.sleep(self.step_s)
        return SampledTokens(torch.full((len(seqs),), FAKE_TOKEN_ID, dtype=torch.long))


def fake_step_core(*args: Any, step_s: float, profile_path: str | None) -> None:
    """The core process's entry (in place of core_process.run_engine_core, which it runs):
    its EngineCore steps with FakeStep; profile_path: cProfile the busy loop into it."""
    from myvllm.serving import core_process

    real_core = core_process.EngineCore

    def make_core(*core_args: Any, **kwargs: Any) -> Any:
        core = real_core(*core_args, **kwargs)
        core.model_runner.run = FakeStep(step_s)
        return core

    core_process.EngineCore = make_core  # type: ignore[misc,assignment]
    if profile_path is not None:
        loop = core_process.EngineCoreProc.run_busy_loop

        def profiled_loop(self: Any) -> None:
            profiler = cProfile.Profile(time.process_time)  # CPU time, not the sleeps
            profiler.enable()
            try:
                loop(self)
            finally:
                profiler.disable()
                profiler.dump_stats(profile_path)

        core_process.EngineCoreProc.run_busy_loop = profiled_loop  # type: ignore[method-assign]
    core_process.run_engine_core(*args)


def run_clients(client: str, processes: int, url: str, prompts: list[list[int]],
                max_tokens: list[int], result: Connection) -> None:
    """The client process (with processes > 1, it starts that many): every request at once,
    its summary (and the events it read, the clients' CPU seconds) back on result."""
    from benchmarks.benchmark_serving import run_at_rate, summarize

    results, duration, client_cpu_s = run_at_rate(client, url, None, prompts, max_tokens,
                                                  math.inf, 0.0, 0, processes)
    summary = summarize(results, duration, math.inf)
    summary["client_cpu_s"] = client_cpu_s
    # Each result's ITL gaps are its events after the first that carried tokens.
    summary["events"] = sum(len(r.itl) + 1 for r in results if r.error is None)
    result.send(summary)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux's /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def print_profile(stats: pstats.Stats, title: str, top: int) -> None:
    for key, name in (("tottime", "own time"), ("cumulative", "cumulative")):
        out = io.StringIO()
        stats.stream = out  # type: ignore[attr-defined]
        stats.sort_stats(key).print_stats(top)
        body = out.getvalue()
        print(f"# {title}, by {name}:")
        print(body[body.find("   ncalls"):].rstrip())


async def measure(llm: Any, server: Any, url: str, client: str, client_processes: int,
                  prompts: list[list[int]],
                  max_tokens: list[int], profile_front: bool) -> dict[str, Any]:
    serving = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.05)
        if serving.done():
            serving.result()  # raises why it stopped
    ctx = mp.get_context("spawn")
    # The clients' function by its module's name: in the child, not this __main__.
    from benchmarks import benchmark_frontend

    async def clients(prompts_: list[list[int]], max_tokens_: list[int]) -> dict[str, Any]:
        receiver, sender = ctx.Pipe(duplex=False)
        process = ctx.Process(target=benchmark_frontend.run_clients,
                              args=(client, client_processes, url, prompts_, max_tokens_,
                                    sender))
        process.start()
        sender.close()
        summary: dict[str, Any] = await asyncio.get_running_loop().run_in_executor(
            None, receiver.recv)
        process.join()
        return summary

    try:
        await clients(prompts[:4], [4] * 4)  # warm-up: connections, first steps
        core_pid = llm._process.pid
        # Admission: every request at once for one token, so that the front end's time is
        # the requests' way in (HTTP, parsing, checks, AddRequest) and one event each.
        admission_profiler = cProfile.Profile(time.process_time) if profile_front else None
        front_before = time.process_time()
        if admission_profiler is not None:
            admission_profiler.enable()
        admitted = await clients(prompts, [1] * len(prompts))
        if admission_profiler is not None:
            admission_profiler.disable()
        admission_cpu_s = time.process_time() - front_before
        front_before, core_before = time.process_time(), cpu_seconds(core_pid)
        # CPU time: the waits for the sockets are not the front end's cost.
        profiler = cProfile.Profile(time.process_time) if profile_front else None
        if profiler is not None:
            profiler.enable()
        summary = await clients(prompts, max_tokens)
        if profiler is not None:
            profiler.disable()
        summary["front_cpu_s"] = time.process_time() - front_before
        summary["core_cpu_s"] = cpu_seconds(core_pid) - core_before
        summary["front_profile"] = profiler
        summary["admission_cpu_s"] = admission_cpu_s
        summary["admission_profile"] = admission_profiler
        summary["admission_ttft_ms"] = admitted["ttft_ms"]
        summary["admission_client_cpu_s"] = admitted["client_cpu_s"]
        return summary
    finally:
        server.should_exit = True
        await serving


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a small run (for CI)")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--min-len", type=int, default=100)
    p.add_argument("--max-input-len", type=int, default=1024)
    p.add_argument("--max-output-len", type=int, default=1024)
    p.add_argument("--step-ms", type=float, default=5.0,
                   help="each fake step's sleep (default %(default)s: about an H200's decode "
                        "step of 256 rows of Qwen3-0.6B)")
    p.add_argument("--client", default="raw", choices=["raw", "httpx", "aiohttp"],
                   help="benchmark_serving.py's client (default %(default)s)")
    p.add_argument("--client-processes", type=int, default=1,
                   help="processes the clients are spread over (default %(default)s)")
    p.add_argument("--profile", choices=["front", "core"], help="cProfile that process")
    p.add_argument("--top", type=int, default=25, help="functions the profile prints")
    p.add_argument("--json", help="write the figures here as JSON")
    args = p.parse_args(argv)
    if args.quick:
        args.num_prompts, args.min_len, args.max_input_len, args.max_output_len = 16, 8, 64, 48

    from benchmarks import benchmark_frontend
    from benchmarks.benchmark_serving import free_port
    from benchmarks.workload import make_workload
    from myvllm.config import Config
    from myvllm.entrypoints.event_loop import serving_loop_factory, serving_loop_name
    from myvllm.entrypoints.openai_server import make_server
    from myvllm.serving import async_llm

    prompts, max_tokens = make_workload(args.num_prompts, args.min_len, args.max_input_len,
                                        args.max_output_len, VOCAB_SIZE)
    tmp = tempfile.TemporaryDirectory(prefix="myvllm-frontend-bench-")
    profile_path = str(Path(tmp.name) / "core.prof") if args.profile == "core" else None
    # Every sequence's blocks at once (the GPU's case: nothing preempted), 16 tokens a block.
    blocks = sum(len(q) + n + 15 for q, n in zip(prompts, max_tokens)) // 16 + 64
    config = Config(model=str(tiny_model_dir(Path(tmp.name))), load_format="dummy",
                    num_kvcache_blocks=blocks, max_model_length=2048, async_scheduling=True)
    # The core process runs the fake steps (its entry, by its module's name: spawned).
    real_entry = async_llm.run_engine_core
    async_llm.run_engine_core = functools.partial(  # type: ignore[assignment]
        benchmark_frontend.fake_step_core, step_s=args.step_ms / 1000,
        profile_path=profile_path)
    try:
        llm = async_llm.AsyncLLM(config)
    finally:  # only this engine's core is fake (the quick runs share one interpreter)
        async_llm.run_engine_core = real_entry
    try:
        port = free_port()
        server = make_server(llm, "fake", "127.0.0.1", port, log_level="warning")
        # The loop `myvllm serve` runs on (uvloop where installed), made here: the server
        # is awaited inside the harness's own coroutine.
        loop = serving_loop_factory()()
        try:
            summary = loop.run_until_complete(measure(
                llm, server, f"http://127.0.0.1:{port}", args.client, args.client_processes,
                prompts, max_tokens, args.profile == "front"))
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            loop.close()
    finally:
        llm.shutdown()
    tokens, events = sum(max_tokens), summary["events"]
    ok = summary["failed"] == 0 and summary["output_tokens_as_requested"]
    front, core = summary["front_cpu_s"], summary["core_cpu_s"]
    print(f"workload: {args.num_prompts} streamed requests at once, {tokens} output tokens, "
          f"fake steps of {args.step_ms:g} ms, client {args.client}, event loop "
          f"{serving_loop_name()}")
    print(f"served: {summary['output_tok_s']:.0f} output tok/s over {summary['duration_s']:.2f}"
          f" s wall, {events} events ({tokens / events:.2f} tokens an event), TTFT p50/p99 "
          f"{summary['ttft_ms']['p50']:.0f}/{summary['ttft_ms']['p99']:.0f} ms")
    for name, cpu in (("front end", front), ("core process", core),
                      (f"client x{args.client_processes}", summary["client_cpu_s"])):
        print(f"{name:>12}: {cpu:.2f} CPU s, {1e6 * cpu / tokens:.1f} us a token, "
              f"{1e6 * cpu / events:.1f} us an event")
    admission = summary["admission_cpu_s"]
    print(f"   admission: {admission:.2f} CPU s in the front end for {args.num_prompts} "
          f"requests of one token at once, {1e3 * admission / args.num_prompts:.2f} ms a "
          f"request (their TTFT p50/p99 {summary['admission_ttft_ms']['p50']:.0f}/"
          f"{summary['admission_ttft_ms']['p99']:.0f} ms; the clients' CPU "
          f"{1e3 * summary['admission_client_cpu_s'] / args.num_prompts:.2f} ms a request)")
    print("all requests completed with the requested number of tokens: "
          + ("OK" if ok else f"NO ({summary['errors']})"))
    if summary["front_profile"] is not None:
        print_profile(pstats.Stats(summary["admission_profile"]), "front end, admission",
                      args.top)
        print_profile(pstats.Stats(summary["front_profile"]), "front end, the workload",
                      args.top)
    if profile_path is not None:
        print_profile(pstats.Stats(profile_path), "core process (the busy loop)", args.top)
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"args": vars(args), "output_tokens": tokens, "events": events,
             "front_cpu_s": front, "core_cpu_s": core, "admission_cpu_s": admission,
             "client_cpu_s": summary["client_cpu_s"],
             "front_us_per_token": 1e6 * front / tokens, "core_us_per_token": 1e6 * core / tokens,
             "output_tok_s": summary["output_tok_s"], "ttft_ms": summary["ttft_ms"],
             "event_loop": serving_loop_name()}, indent=2))
    tmp.cleanup()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
