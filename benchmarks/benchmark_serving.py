"""Online serving benchmark: requests arrive over time at `myvllm serve`, streamed back.

    uv run python benchmarks/benchmark_serving.py            # random Qwen3-0.6B weights
    uv run python benchmarks/benchmark_serving.py --model DIR_OR_HUB_ID --request-rates inf,4,8
    uv run python benchmarks/benchmark_serving.py --base-url http://host:8000  # a server up
    uv run python benchmarks/benchmark_serving.py --quick    # tiny CPU smoke run (CI)

Workload: benchmark_tps.py's (nano-vllm's): prompts of random token ids in [0, 10000) with
lengths uniform in 100..1024, max_tokens uniform in 100..1024, ignore_eos, temperature 0.6.
--shared-prefix-len N starts every prompt with the same N tokens (a system prompt), so the
prefix cache has something to find; with --num-shared-prefixes K there are K such prefixes
and each prompt starts with one of them, drawn at random (a few system prompts, or
conversations: the case for routing by prefix across data-parallel replicas).

Data-parallel replicas: the flags that are not this script's go to `myvllm serve`, so
`--data-parallel-size 2 --data-parallel-routing round_robin` runs two replicas routed in
turn (docs/benchmarks.md has the commands that compare one replica, two, and the routings).

Arrivals: at rate r requests/s the gaps between requests are exponential with mean 1/r (a
Poisson process); "inf" sends everything at once. A rate written "0.8x" is 0.8 times the
request throughput measured by the "inf" run before it, so the default
"inf,0.5x,0.8x,1.0x" measures the peak, then the latencies at 50%, 80% and 100% of it.

Reported per rate, as vLLM's benchmark_serving does:
  request throughput   completed requests / wall time from the first send to the last token
  output tok/s         completion tokens / the same wall time
  TTFT                 time to first token: send -> first streamed token, per request
  TPOT                 time per output token after the first: (e2e - TTFT) / (tokens - 1)
  ITL                  inter-token latency: every gap between two streamed chunks, pooled
Each as p50 / p90 / p99 (ms). A chunk carries one engine step's tokens of that request.
  prefix hits          prompt tokens found in the prefix cache / prompt tokens, over the
                       rate's requests (the server's /metrics counters before and after;
                       summed over the replicas)

The server runs in its own process (started here unless --base-url is given), so the
client's Python does not slow the server's. The client reads the server-sent events of
/v1/completions with stream=true; --clients names which, each running the whole workload in
turn against the same server: "raw" (the default) is plain asyncio over HTTP/1.1, no
dependency; "httpx" is the openai client's transport (httpx2, or httpx); "aiohttp" is vLLM's
benchmark client. A client after the first sends the prompts with every token id moved by its
place in the list (mod the vocabulary): the same lengths, and no prefix-cache hit on what an
earlier client sent. With --compare-offline and with several clients, a table at the end
sets each client's first rate side by side: output tok/s, its ratio to generate(), TTFT.

--client-processes N spreads a rate's requests over N client processes (request i read by
process i mod N, each sent at the arrival time drawn for it, every request timed alone as
before), so that what is measured is the server, not one client core: a client reads ~20k
streamed events a second in the bench workload, and one httpx client costs 54-74 us of CPU an
event (benchmark_frontend.py on a 2-core machine). The default is a quarter of the CPUs, at
most 4. Each row says the clients' CPU seconds.

    uv run python benchmarks/benchmark_serving.py --compare-offline --request-rates inf \
        --clients raw,httpx,aiohttp
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import multiprocessing as mp
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from collections.abc import AsyncIterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "src")]  # benchmarks.* and myvllm, run as a file too


# ---------------------------------------------------------------------------- HTTP clients
# --clients: who reads the streams. "raw" is plain asyncio (no dependency, the least client
# work); "httpx" is the openai client's transport (httpx2, the openai package's, or httpx);
# "aiohttp" is vLLM's benchmark client. Each is imported only when asked for.
CLIENTS = ("raw", "httpx", "aiohttp")


def sse_events(buffer: bytes) -> tuple[list[bytes], bytes]:
    """The complete server-sent events in buffer (their data), and what is left of it."""
    *events, rest = buffer.split(b"\n\n")
    return [e.removeprefix(b"data: ") for e in events if e], rest


class RawClient:
    """POST /v1/completions with stream=true by hand, one connection per request.

    HTTP/1.1: the streamed body comes in chunked transfer encoding ("<size in hex>\\r\\n
    <bytes>\\r\\n", ending with a chunk of size 0)."""

    def __init__(self, url: str) -> None:
        host, port = url.removeprefix("http://").split(":")
        self.host, self.port = host, int(port)

    async def close(self) -> None:
        pass

    async def stream(self, body: dict[str, Any]) -> AsyncIterator[bytes]:
        reader, writer = await asyncio.open_connection(self.host, self.port)
        try:
            payload = json.dumps(body).encode()
            writer.write(f"POST /v1/completions HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
                         f"Content-Type: application/json\r\nContent-Length: {len(payload)}"
                         "\r\nConnection: close\r\n\r\n".encode() + payload)
            await writer.drain()
            status = int((await reader.readline()).split()[1])
            headers = {}
            while (line := await reader.readline()) not in (b"\r\n", b""):
                name, _, value = line.decode().partition(":")
                headers[name.strip().lower()] = value.strip()
            if status != 200:
                raise RuntimeError(f"HTTP {status}: {(await reader.read()).decode()[:500]}")
            chunked = headers.get("transfer-encoding") == "chunked"
            buffer = b""
            while True:
                if chunked:
                    size = int((await reader.readline()).strip() or b"0", 16)
                    if size == 0:
                        break
                    buffer += (await reader.readexactly(size + 2))[:-2]
                else:
                    data = await reader.read(65536)
                    if not data:
                        break
                    buffer += data
                events, buffer = sse_events(buffer)
                for event in events:
                    yield event
        finally:
            writer.close()


class HttpxClient:
    """httpx's AsyncClient, as the openai client streams with it: one pool, no limit on its
    connections (its default of 100 would queue the rest of 256 requests at once)."""

    def __init__(self, url: str) -> None:
        try:
            import httpx2 as httpx  # the openai client's transport since openai 3
        except ImportError:
            import httpx  # type: ignore[no-redef]
        self.client = httpx.AsyncClient(
            base_url=url, timeout=None,
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))

    async def close(self) -> None:
        await self.client.aclose()

    async def stream(self, body: dict[str, Any]) -> AsyncIterator[bytes]:
        async with self.client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode()[:500]
                raise RuntimeError(f"HTTP {response.status_code}: {text}")
            buffer = b""
            async for data in response.aiter_bytes():
                events, buffer = sse_events(buffer + data)
                for event in events:
                    yield event


class AiohttpClient:
    """aiohttp's ClientSession, as vLLM's benchmark_serving reads streams: one session, no
    limit on its connections, the body read line by line."""

    def __init__(self, url: str) -> None:
        import aiohttp

        self.url = f"{url}/v1/completions"
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                             timeout=aiohttp.ClientTimeout(total=None))

    async def close(self) -> None:
        await self.session.close()

    async def stream(self, body: dict[str, Any]) -> AsyncIterator[bytes]:
        async with self.session.post(self.url, json=body) as response:
            if response.status != 200:
                raise RuntimeError(f"HTTP {response.status}: {(await response.text())[:500]}")
            async for line in response.content:
                line = line.strip()
                if line:
                    yield line.removeprefix(b"data: ")


def open_client(name: str, url: str) -> RawClient | HttpxClient | AiohttpClient:
    """A client of --clients, opened in the running event loop."""
    return {"raw": RawClient, "httpx": HttpxClient, "aiohttp": AiohttpClient}[name](url)


@dataclass
class RequestResult:
    prompt_len: int
    max_tokens: int
    output_tokens: int = 0
    ttft: float = math.nan
    e2e: float = math.nan
    itl: list[float] = field(default_factory=list)
    error: str | None = None


async def one_request(client: RawClient | HttpxClient | AiohttpClient, model: str | None,
                      prompt: list[int], max_tokens: int, temperature: float) -> RequestResult:
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": max_tokens,
                            "temperature": temperature, "ignore_eos": True, "stream": True,
                            "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    result = RequestResult(len(prompt), max_tokens)
    start = last = time.perf_counter()
    try:
        async with contextlib.aclosing(client.stream(body)) as events:
            async for data in events:
                now = time.perf_counter()
                if data == b"[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    raise RuntimeError(event["error"]["message"])
                if event.get("usage"):
                    result.output_tokens = event["usage"]["completion_tokens"]
                if not event["choices"]:
                    continue
                if math.isnan(result.ttft):
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
        result.e2e = last - start
    except Exception as e:  # any client's errors (httpx and aiohttp have their own kinds)
        result.error = f"{type(e).__name__}: {e}"  # the request counts as failed
    return result


def arrival_offsets(count: int, rate: float, seed: int) -> list[float]:
    """Each request's send time, in seconds after the start: all 0 at rate inf, else a Poisson
    process's (exponential gaps of mean 1/rate)."""
    rng = random.Random(seed)
    offsets, at = [], 0.0
    for _ in range(count):
        offsets.append(at)
        if rate != math.inf:
            at += rng.expovariate(rate)
    return offsets


async def run_share(client_name: str, url: str, model: str | None, prompts: list[list[int]],
                    max_tokens: list[int], offsets: list[float], temperature: float,
                    start_at: Any) -> tuple[list[RequestResult], float]:
    """One client process's requests, each sent at start + its offset (perf_counter's clock,
    CLOCK_MONOTONIC on Linux: the same in every process). start_at: the start, or a
    function that waits for it once the client is open. Returns the results and when the
    last one ended."""
    client = open_client(client_name, url)
    try:
        start = start_at() if callable(start_at) else start_at
        tasks = []
        for prompt, n, offset in zip(prompts, max_tokens, offsets):
            if (delay := start + offset - time.perf_counter()) > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one_request(client, model, prompt, n,
                                                         temperature)))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter()
    finally:
        await client.close()


def client_process(client_name: str, url: str, model: str | None, prompts: list[list[int]],
                   max_tokens: list[int], offsets: list[float], temperature: float,
                   conn: Connection) -> None:
    """A client process of --client-processes: says "ready" once its client is open, is
    sent the start, and sends back its results, when its last request ended, and its CPU
    seconds."""
    cpu_at_start = 0.0

    def wait_for_start() -> float:
        nonlocal cpu_at_start
        conn.send("ready")
        start: float = conn.recv()
        cpu_at_start = time.process_time()  # not the imports and the start-up
        return start

    results, end = asyncio.run(run_share(client_name, url, model, prompts, max_tokens, offsets,
                                         temperature, wait_for_start))
    conn.send((results, end, time.process_time() - cpu_at_start))


def run_at_rate(client_name: str, url: str, model: str | None, prompts: list[list[int]],
                max_tokens: list[int], rate: float, temperature: float, seed: int,
                processes: int = 1) -> tuple[list[RequestResult], float, float]:
    """The requests at the rate, read by processes client processes (request i by process
    i mod processes; 1: in this one), each request timed alone as before. Returns the
    results in the order of prompts, the wall time from the first send to the last token,
    and the clients' CPU seconds."""
    offsets = arrival_offsets(len(prompts), rate, seed)
    processes = min(processes, len(prompts))  # none without requests
    if processes <= 1:
        cpu = time.process_time()
        start = time.perf_counter()
        results, end = asyncio.run(run_share(client_name, url, model, prompts, max_tokens,
                                             offsets, temperature, start))
        return results, end - start, time.process_time() - cpu
    from benchmarks import benchmark_serving  # the child's function by its module's name

    ctx = mp.get_context("spawn")
    pipes, children = [], []
    for k in range(processes):
        parent_end, child_end = ctx.Pipe()
        children.append(ctx.Process(target=benchmark_serving.client_process, args=(
            client_name, url, model, prompts[k::processes], max_tokens[k::processes],
            offsets[k::processes], temperature, child_end), daemon=True))
        children[-1].start()
        child_end.close()
        pipes.append(parent_end)
    try:
        for conn in pipes:
            if conn.recv() != "ready":
                raise RuntimeError("a client process did not start")
        start = time.perf_counter() + 0.05  # every process is waiting for it
        for conn in pipes:
            conn.send(start)
        shares = [conn.recv() for conn in pipes]
    except EOFError:
        raise RuntimeError("a client process ended without its results (its error is "
                           "above)") from None
    finally:
        for child in children:
            child.join(timeout=60)
    results: list[RequestResult] = [None] * len(prompts)  # type: ignore[list-item]
    for k, (share, _, _) in enumerate(shares):
        results[k::processes] = share
    return (results, max(end for _, end, _ in shares) - start,
            sum(cpu for _, _, cpu in shares))


def default_client_processes() -> int:
    """Enough client processes that one client core is not the limit, leaving the server its
    cores: an httpx client costs 54-74 us of CPU an event (benchmark_frontend.py on a 2-core
    machine), about a core at the ~20k events a second of the bench workload on a GPU."""
    return max(1, min(4, (os.cpu_count() or 1) // 4))


# ---------------------------------------------------------------------------- statistics
def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": math.nan, "p90": math.nan, "p99": math.nan}
    ordered = sorted(values)

    def at(q: float) -> float:  # linear interpolation, as numpy.percentile
        pos = q * (len(ordered) - 1)
        lo = math.floor(pos)
        hi = min(lo + 1, len(ordered) - 1)
        return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)

    return {"p50": at(0.5), "p90": at(0.9), "p99": at(0.99)}


def summarize(results: list[RequestResult], duration: float, rate: float) -> dict[str, Any]:
    done = [r for r in results if r.error is None]
    output_tokens = sum(r.output_tokens for r in done)
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    ms = lambda xs: {k: v * 1000 for k, v in percentiles(xs).items()}  # noqa: E731
    return {
        "request_rate": rate, "completed": len(done), "failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if r.error})[:3],
        "duration_s": duration,
        "request_throughput": len(done) / duration,
        "output_tok_s": output_tokens / duration,
        "total_tok_s": (output_tokens + sum(r.prompt_len for r in done)) / duration,
        "output_tokens_as_requested": all(r.output_tokens == r.max_tokens for r in done),
        "ttft_ms": ms([r.ttft for r in done]),
        "tpot_ms": ms(tpot),
        "itl_ms": ms([gap for r in done for gap in r.itl]),
        "e2e_ms": ms([r.e2e for r in done]),
    }


def prefix_cache_counts(url: str) -> tuple[float, float]:
    """(hit tokens, queried tokens) of the server's prefix cache, from /metrics."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as response:
        text = response.read().decode()
    values = {"myvllm:prefix_cache_hits_total": 0.0, "myvllm:prefix_cache_queries_total": 0.0}
    for line in text.splitlines():
        name = line.split("{")[0].split(" ")[0]
        if name in values:
            values[name] += float(line.rsplit(" ", 1)[1])
    return values["myvllm:prefix_cache_hits_total"], values["myvllm:prefix_cache_queries_total"]


def print_row(s: dict[str, Any]) -> None:
    rate = "inf" if s["request_rate"] == math.inf else f"{s['request_rate']:.2f}"
    lat = "  ".join(f"{name} {s[key]['p50']:.1f}/{s[key]['p90']:.1f}/{s[key]['p99']:.1f}"
                    for name, key in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"),
                                      ("ITL", "itl_ms")))
    print(f"{s['client']:>7}, rate {rate:>6} req/s: {s['completed']} done, {s['failed']} failed, "
          f"{s['request_throughput']:.2f} req/s, {s['output_tok_s']:.0f} output tok/s"
          + ("" if math.isnan(s.get("vs_offline", math.nan)) else
             f" ({s['vs_offline']:.2f}x offline)")
          + f", prefix hits {100 * s.get('prefix_hit_rate', math.nan):.1f}%, client CPU "
          f"{s['client_cpu_s']:.1f} s in {s['client_processes']} process(es) | "
          f"ms p50/p90/p99: {lat}", flush=True)


def print_clients(summaries: list[dict[str, Any]]) -> None:
    """Each client's first rate side by side (with --compare-offline, against generate())."""
    if len({s["client"] for s in summaries}) < 2 and math.isnan(summaries[0]["vs_offline"]):
        return
    print("client   rate    output tok/s  vs offline  TTFT p50 / p99 ms")
    seen = set()
    for s in summaries:
        if s["client"] in seen:
            continue
        seen.add(s["client"])
        ratio = "-" if math.isnan(s["vs_offline"]) else f"{s['vs_offline']:.3f}x"
        print(f"{s['client']:<8} {s['rate_spec']:<7} {s['output_tok_s']:>12.0f}  {ratio:>10}  "
              f"{s['ttft_ms']['p50']:.1f} / {s['ttft_ms']['p99']:.1f}", flush=True)


def plot(summaries: list[dict[str, Any]], path: str) -> None:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed (uv sync --extra bench): no plot")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [s for s in summaries if s["request_rate"] != math.inf
            and s["client"] == summaries[0]["client"]]
    if not rows:
        return
    x = [s["request_throughput"] for s in rows]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, key, title in zip(axes, ("ttft_ms", "tpot_ms", "itl_ms"),
                              ("time to first token", "time per output token",
                               "inter-token latency")):
        for q, style in (("p50", "o-"), ("p90", "s--"), ("p99", "^:")):
            ax.plot(x, [s[key][q] for s in rows], style, label=q)
        ax.set_xlabel("achieved request throughput (req/s)")
        ax.set_ylabel("ms")
        ax.set_title(title)
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


# ---------------------------------------------------------------------------- the server
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen | None, timeout_s: float = 900) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode} while starting")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError):
            pass
        time.sleep(0.5)
    raise SystemExit(f"{url}/health did not answer 200 within {timeout_s} s")


def start_server(model: str, port: int, server_args: list[str]) -> subprocess.Popen:
    command = [sys.executable, "-m", "myvllm.entrypoints.cli", "serve", model,
               "--port", str(port), "--log-level", "warning", *server_args]
    print("server:", " ".join(command), flush=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(REPO / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]))
    return subprocess.Popen(command, env=env)


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise SystemExit("the server did not stop within 60 s of SIGTERM") from None
    if code != 0:
        raise SystemExit(f"the server exited with {code} after SIGTERM")


# ---------------------------------------------------------------------------- offline anchor
def run_offline(model: str, server_args: list[str], prompts: list[list[int]],
                max_tokens: list[int], temperature: float, warmup: list[list[int]]) -> float:
    """generate() on the same requests and engine settings as the server gets: output tok/s
    (one warm-up call first, as the server gets). Runs in a child process (--offline-only),
    so that its GPU memory is free again before the server starts."""
    from myvllm import LLM, SamplingParams
    from myvllm.entrypoints import cli

    config = cli.engine_config(cli.build_parser().parse_args(["serve", model, *server_args]))
    llm = LLM(config)
    try:
        llm.generate(warmup, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
        params = [SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=True)
                  for n in max_tokens]
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
    finally:
        llm.exit()
    assert [len(o["token_ids"]) for o in outputs] == max_tokens
    return sum(max_tokens) / elapsed


def offline_in_child(argv: list[str]) -> float:
    """Output tok/s of generate(), measured by this script run with --offline-only."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(REPO / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]))
    done = subprocess.run([sys.executable, __file__, "--offline-only", *argv], env=env,
                          stdout=subprocess.PIPE, text=True, check=True)
    line = [x for x in done.stdout.splitlines() if x.startswith("offline output tok/s: ")][-1]
    return float(line.split(": ")[1])


# ---------------------------------------------------------------------------- main
def parse_rates(text: str) -> list[str]:
    rates = [r.strip() for r in text.split(",") if r.strip()]
    for r in rates:
        if r != "inf" and not (r.endswith("x") and _positive(r[:-1])) and not _positive(r):
            raise argparse.ArgumentTypeError(f"a rate is a number, 'inf' or a fraction of the "
                                             f"peak like '0.8x'; got {r!r}")
    if rates and rates[0].endswith("x"):
        raise argparse.ArgumentTypeError("a rate like '0.8x' needs an 'inf' run before it")
    return rates


def parse_clients(text: str) -> list[str]:
    clients = [c.strip() for c in text.split(",") if c.strip()]
    unknown = [c for c in clients if c not in CLIENTS]
    if unknown or not clients or len(set(clients)) < len(clients):
        raise argparse.ArgumentTypeError(f"--clients takes a comma-separated list without "
                                         f"repeats; allowed: {', '.join(CLIENTS)}; got {text!r}")
    return clients


def shifted(prompts: list[list[int]], shift: int, vocab: int) -> list[list[int]]:
    """The prompts with every token id moved by shift (mod vocab): the same lengths and the
    same prefixes shared among them, none of another client's blocks in the prefix cache."""
    return [[(t + shift) % vocab for t in prompt] for prompt in prompts]


def positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"a whole number >= 1; got {text!r}")
    return int(text)


def _positive(text: str) -> bool:
    try:
        return float(text) > 0
    except ValueError:
        return False


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny CPU smoke run (for CI)")
    p.add_argument("--model", help="checkpoint dir, .gguf or hub id (default: random "
                   "Qwen3-0.6B weights from configs/Qwen3-0.6B/config.json)")
    p.add_argument("--base-url", help="benchmark a server that is already running")
    p.add_argument("--num-prompts", type=int, default=256, help="requests per rate")
    p.add_argument("--min-len", type=int, default=100)
    p.add_argument("--max-input-len", type=int, default=1024)
    p.add_argument("--max-output-len", type=int, default=1024)
    p.add_argument("--shared-prefix-len", type=int, default=0,
                   help="tokens every prompt starts with (the prefix cache's case)")
    p.add_argument("--num-shared-prefixes", type=int, default=1,
                   help="with --shared-prefix-len: this many different prefixes, each prompt "
                        "starting with one drawn at random (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--request-rates", type=parse_rates, default=parse_rates("inf,0.5x,0.8x,1.0x"),
                   help="comma-separated: req/s, 'inf' (all at once), or '0.8x' of the "
                        "peak measured by the 'inf' run before (default: %(default)s)")
    p.add_argument("--clients", type=parse_clients, default=["raw"],
                   help="comma-separated, each running the whole workload in turn: "
                        f"{', '.join(CLIENTS)} (default: raw)")
    p.add_argument("--client-processes", type=positive_int, default=default_client_processes(),
                   help="processes the requests are spread over (request i read by process "
                        "i mod N), so that one client core is not what is measured (default "
                        "here: %(default)s, a quarter of the CPUs, at most 4)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the results here as JSON")
    p.add_argument("--plot", default=str(REPO / "docs" / "benchmark_serving.png"))
    p.add_argument("--compare-offline", action="store_true",
                   help="first time generate() on the same requests and settings (in a child "
                        "process), and report each rate's output tok/s as a ratio of it")
    p.add_argument("--offline-only", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)  # the parent's random checkpoint
    args, server_args = p.parse_known_args(argv)  # the rest goes to `myvllm serve`

    if args.quick:
        args.num_prompts, args.min_len = 8, 8
        args.max_input_len, args.max_output_len = 48, 16
        args.request_rates = parse_rates("inf,0.8x")
        args.plot = None
        server_args += ["--num-kvcache-blocks", "64", "--max-model-length", "256"]

    from benchmarks.workload import QWEN3_CONFIG, build_random_checkpoint, make_workload

    tmp = tempfile.TemporaryDirectory(prefix="myvllm-serving-bench-")
    model = args.model or args.model_dir
    vocab = 10000 if not args.quick else 512  # 512: the tiny model's vocabulary
    if model is None and args.base_url is None:
        import torch

        device = "cuda" if torch.cuda.is_available() and not args.quick else "cpu"
        model = str(build_random_checkpoint(None if args.quick else QWEN3_CONFIG,
                                            Path(tmp.name), device, args.quick))
    prompts, max_tokens = make_workload(args.num_prompts, args.min_len, args.max_input_len,
                                        args.max_output_len, vocab)
    if args.num_shared_prefixes < 1:
        raise SystemExit(f"--num-shared-prefixes must be >= 1, got {args.num_shared_prefixes}")
    if args.shared_prefix_len:
        rng = random.Random(args.seed + 1)
        prefixes = [[rng.randrange(vocab) for _ in range(args.shared_prefix_len)]
                    for _ in range(args.num_shared_prefixes)]
        prompts = [rng.choice(prefixes) + p for p in prompts]

    # Warm-up requests (the server's and generate()'s) with token ids no client sends: none
    # of the measured prompts is in the prefix cache when its client starts.
    warmup = shifted(prompts[:4], len(args.clients), vocab)
    if args.offline_only:
        assert model is not None
        tok_s = run_offline(model, server_args, prompts, max_tokens, args.temperature, warmup)
        print(f"offline output tok/s: {tok_s:.1f}", flush=True)
        return 0
    offline = math.nan
    if args.compare_offline:
        assert model is not None, "--compare-offline needs the model (not --base-url)"
        child_argv = [a for a in (argv if argv is not None else sys.argv[1:])
                      if a != "--compare-offline"]
        offline = offline_in_child(["--model-dir", model, *child_argv])
        print(f"offline generate(): {offline:.0f} output tok/s", flush=True)

    proc = None
    if args.base_url:
        url = args.base_url.rstrip("/")
    else:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        proc = start_server(model, port, server_args)
    try:
        wait_healthy(url, proc)
        # Warm-up: compile kernels for the shapes to come, outside the measurement.
        run_at_rate(args.clients[0], url, None, warmup, [4] * 4, math.inf, args.temperature,
                    args.seed)
        summaries: list[dict[str, Any]] = []
        for k, client in enumerate(args.clients):
            # Each client after the first gets the prompts with their token ids moved by k:
            # the same work, and no prefix-cache hit on a prompt an earlier client sent.
            client_prompts = shifted(prompts, k, vocab) if k else prompts
            peak = math.nan
            for spec in args.request_rates:
                rate = (math.inf if spec == "inf" else
                        float(spec[:-1]) * peak if spec.endswith("x") else float(spec))
                hits_before, queries_before = prefix_cache_counts(url)
                results, duration, client_cpu_s = run_at_rate(
                    client, url, None, client_prompts, max_tokens, rate, args.temperature,
                    args.seed, args.client_processes)
                hits, queries = prefix_cache_counts(url)
                summary = summarize(results, duration, rate)
                summary["prefix_hit_rate"] = ((hits - hits_before) / (queries - queries_before)
                                              if queries > queries_before else math.nan)
                summary["client"] = client
                summary["client_processes"] = args.client_processes
                summary["client_cpu_s"] = client_cpu_s
                summary["rate_spec"] = spec
                summary["offline_output_tok_s"] = offline
                summary["vs_offline"] = summary["output_tok_s"] / offline
                if spec == "inf":
                    peak = summary["request_throughput"]
                summaries.append(summary)
                print_row(summary)
    finally:
        if proc is not None:
            stop_server(proc)
        tmp.cleanup()

    print_clients(summaries)
    ok = all(s["failed"] == 0 and s["output_tokens_as_requested"] for s in summaries)
    print("all requests completed with the requested number of tokens: "
          + ("OK" if ok else f"NO ({[s['errors'] for s in summaries]})"))
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"args": {k: v for k, v in vars(args).items() if k != "request_rates"},
             "server_args": server_args, "results": summaries}, indent=2, default=str))
    if args.plot:
        plot(summaries, args.plot)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
