"""Latency of the scheduler's choices: the decode stall when a long prompt joins, time to first
token, and the token budget's trade-off between the two and throughput.

    uv run python benchmarks/benchmark_latency.py --quick   # tiny CPU run (CI)
    python benchmarks/benchmark_latency.py                  # on a GPU: stall, TTFT, sweep, plot

1. Stall: 64 sequences decode; then one 16,000-token prompt arrives. The longest step until
   that prompt has its first token, over the median decode step before it. Prefill-first
   runs the whole prompt in one step beside nobody; chunked prefill cuts it into pieces of
   what the budget leaves after the decode rows. Measured twice with the defaults: as the
   gaps between two streamed tokens (what a client sees: with async scheduling the host
   plans a step while the device runs the one before), then with each step timed alone,
   the device drained before and after it (its host and device work added up).
2. Time to first token of one prompt alone (1k, 4k, 32k tokens): generate(max_tokens=1),
   median of 5.
3. Sweep of max_prefill_tokens_while_decoding (the prompt tokens a step may add beside decode
   rows) and of max_num_batched_tokens: the stall, the offline throughput of
   benchmark_tps.py's workload (through generate(), whose own sequences stream to nobody:
   the cap does not apply to them) and the longest prompt's time to first token at each
   setting (and prefill-first for reference); a plot.

Random weights of the Qwen3-0.6B architecture (configs/Qwen3-0.6B/config.json).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny CPU smoke run (for CI)")
    parser.add_argument("--budgets", default="8192,16384,32768",
                        help="comma-separated max_num_batched_tokens values for the sweep")
    parser.add_argument("--caps", default="256,512,1024,2048,0",
                        help="comma-separated max_prefill_tokens_while_decoding values for the "
                             "sweep (0 = no cap), each at every budget")
    parser.add_argument("--skip-sweep", action="store_true")
    parser.add_argument("--skip-defaults", action="store_true",
                        help="only the sweep (skip the stall and TTFT with the defaults)")
    parser.add_argument("--json", help="write the results here as JSON")
    parser.add_argument("--plot", default=str(REPO / "docs" / "benchmark_latency.png"))
    return parser.parse_args()


if __name__ == "__main__":
    parse_args()  # --help and bad arguments answer here, before torch's import (seconds)

import torch  # noqa: E402

sys.path[:0] = [str(REPO), str(REPO / "src")]  # benchmarks.* and myvllm, run as a file too

from benchmarks.workload import QWEN3_CONFIG, build_random_checkpoint, make_workload  # noqa: E402


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def measure_stall(llm, num_decoding: int, decode_prompt_len: int, long_prompt_len: int,
                  vocab: int, synced: bool = True, salt: int = 0) -> dict[str, float]:
    """Step times while num_decoding sequences decode, then while a long prompt joins.

    synced: each step is timed alone, with the device drained before and after it: its host
    work (planning, launching) and its device work one after the other. Otherwise the time
    between two calls' returns is timed with nothing drained, i.e. the gap between two
    tokens of every decoding stream, as a client sees it: with async scheduling the host
    plans and launches a step while the device still runs the one before.
    salt changes every prompt, so that a second call on one engine hits no cached prefix.
    """
    from myvllm import SamplingParams

    last_return = time.perf_counter()

    def timed_step() -> tuple[float, list]:
        nonlocal last_return
        if synced:
            sync()
            start = time.perf_counter()
            outputs, _ = llm.step_outputs()
            sync()
            return time.perf_counter() - start, outputs
        outputs, _ = llm.step_outputs()
        now = time.perf_counter()
        gap, last_return = now - last_return, now
        return gap, outputs

    rng_prompt = [[(7 * i + j + salt) % vocab for j in range(decode_prompt_len)]
                  for i in range(num_decoding)]
    # Decode until aborted: as many tokens as the context leaves (more would be refused).
    decode = SamplingParams(temperature=0.0, max_tokens=llm.max_model_length - decode_prompt_len,
                            ignore_eos=True)
    ids = [llm.add_request(p, decode) for p in rng_prompt]
    started: set[int] = set()
    while len(started) < len(ids):  # until every sequence has its first token
        outputs, _ = llm.step_outputs()
        started.update(out.request_id for out in outputs)
    for _ in range(5):  # steady state: every sequence decodes
        llm.step()
    timed_step()  # (unsynced: the first return to time from)
    before = [timed_step()[0] for _ in range(30)]
    long_id = llm.add_request([(3 * j + 1 + salt) % vocab for j in range(long_prompt_len)],
                              SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    after = []
    first_token_s = None
    joined = time.perf_counter()
    while first_token_s is None:
        step_s, outputs = timed_step()
        after.append(step_s)
        if any(out.request_id == long_id for out in outputs):
            first_token_s = time.perf_counter() - joined
    for request_id in ids:
        llm.abort(request_id)
    while not llm.is_finished():
        llm.step()
    median = statistics.median(before)
    return {"median_step_ms": median * 1e3, "longest_step_after_join_ms": max(after) * 1e3,
            "steps_after_join_ms": [round(t * 1e3, 2) for t in after],
            "stall_x": max(after) / median, "steps_until_first_token": len(after),
            "long_prompt_ttft_s": first_token_s}


def measure_ttft(llm, lengths: list[int], vocab: int) -> dict[int, float]:
    from myvllm import SamplingParams

    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    result = {}
    for n in lengths:
        # Every prompt new, also across lengths (its first token depends on n): a prefix-cache
        # hit would make the time to first token that of the uncached part only.
        prompts = [[(11 * r + 5 * j + 7 * n + 1) % vocab for j in range(n)] for r in range(6)]
        llm.generate([prompts[0]], one, use_tqdm=False)  # warm (and compile)
        times = []
        for prompt in prompts[1:]:
            sync()
            start = time.perf_counter()
            llm.generate([prompt], one, use_tqdm=False)
            sync()
            times.append(time.perf_counter() - start)
        result[n] = statistics.median(times) * 1e3
    return result


def throughput(llm, quick: bool, vocab: int) -> float:
    from myvllm import SamplingParams

    num, lo, hi = (6, 8, 24) if quick else (256, 100, 1024)
    prompts, max_tokens = make_workload(num, lo, hi, hi, vocab)
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in max_tokens]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)
    sync()
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    sync()
    return sum(max_tokens) / (time.perf_counter() - start)


def build(path: Path, quick: bool, **kwargs):
    from myvllm import LLM

    size = dict(max_num_sequences=8, max_model_length=512) if quick else {}
    return LLM(str(path), **{**size, **kwargs})


def free_memory() -> None:
    """After the caller dropped its engine: give its KV cache back before the next one."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main() -> None:
    args = parse_args()
    quick = args.quick or not torch.cuda.is_available()
    shapes = (dict(num_decoding=4, decode_prompt_len=8, long_prompt_len=200, ttft=[64, 256])
              if quick else dict(num_decoding=64, decode_prompt_len=128,
                                 long_prompt_len=16_000, ttft=[1024, 4096, 32_000]))
    budgets = [32, 256] if quick else [int(b) for b in args.budgets.split(",")]
    caps = [8, 0] if quick else [int(c) for c in args.caps.split(",")]
    results: dict[str, object] = {"device": torch.cuda.get_device_name()
                                  if torch.cuda.is_available() else "cpu",
                                  "torch": torch.__version__}
    with tempfile.TemporaryDirectory() as tmp:
        path = build_random_checkpoint(QWEN3_CONFIG, Path(tmp), "cuda" if not quick else "cpu",
                                       quick)
        vocab = 500 if quick else 10_000
        stall_kw = {k: shapes[k] for k in ("num_decoding", "decode_prompt_len",
                                           "long_prompt_len")}

        if not args.skip_defaults:
            defaults(path, quick, shapes, stall_kw, vocab, results)

        if not args.skip_sweep:
            sweep = []
            modes = ([(b, cap, True) for b in budgets for cap in caps]
                     + [(max(budgets), 0, False)])
            for budget, cap, chunked in modes:
                # Prefill-first must fit every sequence in one prefill: max_model_length
                # is the budget there; chunked runs take the default.
                extra = ({"max_prefill_tokens_while_decoding": cap} if chunked
                         else {"max_model_length": budget})
                llm = build(path, quick, max_num_batched_tokens=budget,
                            enable_chunked_prefill=chunked, **extra)
                row = measure_stall(llm, **{**stall_kw, "long_prompt_len": min(
                    shapes["long_prompt_len"], llm.config.max_model_length - 1)}, vocab=vocab)
                longest = min(shapes["ttft"][-1], llm.config.max_model_length - 1)
                row.update(budget=budget, cap=cap, chunked=chunked,
                           tok_s=throughput(llm, quick, vocab),
                           ttft_longest_ms=measure_ttft(llm, [longest], vocab)[longest])
                print(f"{'chunked' if chunked else 'prefill-first':>13} budget {budget:>6} "
                      f"cap {cap:>5}: stall {row['stall_x']:5.1f}x, "
                      f"{row['tok_s']:,.0f} output tok/s, time to first token of "
                      f"{longest} tokens alone {row['ttft_longest_ms']:.1f} ms", flush=True)
                sweep.append(row)
                llm.exit()
                del llm
                free_memory()
            results["sweep"] = sweep
            if not quick:
                plot(sweep, Path(args.plot))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


def defaults(path: Path, quick: bool, shapes: dict, stall_kw: dict, vocab: int,
             results: dict[str, object]) -> None:
    """The stall and time to first token with the engine's defaults."""
    llm = build(path, quick)
    config = llm.config
    print(f"defaults: enable_chunked_prefill={config.enable_chunked_prefill}, "
          f"max_num_batched_tokens={config.max_num_batched_tokens}, "
          f"max_prefill_tokens_while_decoding={config.max_prefill_tokens_while_decoding}, "
          f"max_model_length={config.max_model_length}")
    # The gaps first, on the fresh engine: a cost paid once per engine lands in them.
    gaps = measure_stall(llm, **stall_kw, vocab=vocab, synced=False)
    stall = measure_stall(llm, **stall_kw, vocab=vocab, salt=1)
    for name, row, what in (("gaps", gaps, "gap between two streamed tokens"),
                            ("stall", stall, "step, drained before and after")):
        print(f"{name} (defaults): median {what} {row['median_step_ms']:.2f} ms, longest "
              f"after a {shapes['long_prompt_len']}-token prompt joins "
              f"{row['longest_step_after_join_ms']:.2f} ms = {row['stall_x']:.1f}x "
              f"({row['steps_until_first_token']} steps to its first token)", flush=True)
    ttft = measure_ttft(llm, shapes["ttft"], vocab)
    for n, ms in ttft.items():
        print(f"time to first token, {n} tokens alone (defaults): {ms:.1f} ms")
    results["defaults"] = {"stall": stall, "stream_gaps": gaps, "ttft_ms": ttft,
                           "max_num_batched_tokens": config.max_num_batched_tokens,
                           "max_prefill_tokens_while_decoding":
                               config.max_prefill_tokens_while_decoding}
    llm.exit()
    del llm
    free_memory()


def plot(sweep: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for row in sweep:
        marker = "o" if row["chunked"] else "s"
        ax.scatter(row["stall_x"], row["tok_s"], marker=marker,
                   color="tab:blue" if row["chunked"] else "tab:red")
        label = (f"cap {row['cap'] or 'none'}, budget {row['budget']}" if row["chunked"]
                 else f"prefill-first, budget {row['budget']}")
        label += f"; long TTFT {row['ttft_longest_ms']:.0f} ms"
        ax.annotate(label, (row["stall_x"], row["tok_s"]), textcoords="offset points",
                    xytext=(5, 4), fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel("decode stall when a 16k-token prompt joins 64 decoding sequences (x median)")
    ax.set_ylabel("offline throughput, output tok/s")
    ax.set_title("prompt tokens beside decode rows: throughput against stall")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
