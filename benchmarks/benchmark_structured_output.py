"""What structured outputs cost one decode step: the sampler with and without a token
bitmask on the device, and the host's work to fill the bitmask (xgrammar), at batch 256.

    PYTHONPATH=src python3 benchmarks/benchmark_structured_output.py            # GPU, batch 256
    PYTHONPATH=src python3 benchmarks/benchmark_structured_output.py --quick    # CPU, a small batch

The logits are the bundled model's width (SmolLM2: 49152) unless --vocab says otherwise;
the bitmask is a real one: every row's matcher is a JSON schema's, part way through an
object. Correctness first: each sampled token is one its bitmask allows (OK / NO), then the
times (median over --iters calls; the device's by CUDA events, the host's by perf_counter).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "src")]  # benchmarks.* and myvllm, run as a file too

from benchmarks.device import require_gpu  # noqa: E402
from myvllm.structured_output.manager import StructuredOutputManager, fill_token_bitmask  # noqa: E402
from myvllm.engine.sequence import Sequence  # noqa: E402
from myvllm.layers.sampler import Sampler  # noqa: E402
from myvllm.layers.token_bitmask import apply_token_bitmask  # noqa: E402
from myvllm.sampling_parameters import SamplingParams, StructuredOutputsParams  # noqa: E402
from myvllm.utils.model_path import resolve_model_path  # noqa: E402

SCHEMA = {"type": "object", "required": ["name", "age", "tags"], "properties": {
    "name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}}}}
PREFIX = '{"name": "Ada", "age": 3'  # where each row's matcher is when the step samples


def time_device(fn: Callable[[], object], iters: int, device: torch.device) -> float:
    """Median milliseconds of fn on the device (CUDA events), or on the host for a CPU."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CPU, batch 8, few iterations")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args()
    device = torch.device("cpu") if args.quick and not torch.cuda.is_available() else (
        require_gpu(__file__))
    batch, iters = (8, 3) if args.quick else (args.batch, args.iters)

    model_path = resolve_model_path(None)  # the bundled model: its tokenizer
    from myvllm.utils.hf_config import load_hf_config
    vocab = load_hf_config(model_path).vocab_size
    manager = StructuredOutputManager(model_path, vocab, [2])
    so = StructuredOutputsParams(json=SCHEMA)
    seqs = []
    for _ in range(batch):
        seq = Sequence([1], block_size=16, sampling_params=SamplingParams(structured_outputs=so))
        assert seq.extras is not None  # a grammar is a feature: its state is in extras
        seq.extras.grammar_matcher = manager.matcher_for(so)
        assert seq.extras.grammar_matcher.accept_string(PREFIX)
        seq.num_computed_tokens = seq.num_tokens  # it samples this step
        seqs.append(seq)
    samples = [True] * batch

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    logits = torch.randn(batch, vocab, device=device, dtype=dtype) * 3
    temperatures = torch.full((batch,), 0.8, device=device)
    host_bitmask = fill_token_bitmask(seqs, samples, vocab)
    assert host_bitmask is not None
    bitmask = host_bitmask.to(device)
    sampler = Sampler()

    allowed = torch.isfinite(apply_token_bitmask(torch.zeros(batch, vocab, device=device),
                                                 bitmask))
    print(f"# batch {batch}, vocab {vocab}, {dtype}, {device}; "
          f"{int(allowed[0].sum())} tokens allowed a row")
    print(f"{'step':44s} {'correct':>7s} {'ms':>9s}")
    rows: list[tuple[str, Callable[[], object], bool]] = [
        ("sampler, temperature 0.8", lambda: sampler(logits, temperatures, all_greedy=False),
         False),
        ("sampler, temperature 0.8, with the bitmask", lambda: sampler(
            apply_token_bitmask(logits, bitmask), temperatures, all_greedy=False), True),
        ("sampler, greedy", lambda: sampler(logits, temperatures * 0, all_greedy=True), False),
        ("sampler, greedy, with the bitmask", lambda: sampler(
            apply_token_bitmask(logits, bitmask), temperatures * 0, all_greedy=True), True),
        ("apply_token_bitmask alone", lambda: apply_token_bitmask(logits, bitmask), False),
    ]
    for name, fn, masked in rows:
        verdict = "-"
        if masked:
            tokens = fn()
            assert isinstance(tokens, torch.Tensor)
            ok = bool(allowed[torch.arange(batch, device=device), tokens].all())
            verdict = "OK" if ok else "NO"
        print(f"{name:44s} {verdict:>7s} {time_device(fn, iters, device):9.3f}")

    # The host's part of every constrained step: the matchers fill the bitmask, which then
    # goes to the device. Each fill leaves the matcher where it was.
    def host_fill() -> None:
        filled = fill_token_bitmask(seqs, samples, vocab)
        assert filled is not None
        filled.to(device)
        if device.type == "cuda":
            torch.cuda.synchronize()

    host_times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        host_fill()
        host_times.append((time.perf_counter() - t0) * 1e3)
    same = torch.equal(fill_token_bitmask(seqs, samples, vocab), host_bitmask)  # type: ignore[arg-type]
    print(f"{'host: fill the bitmask + copy (xgrammar)':44s} {'OK' if same else 'NO':>7s} "
          f"{statistics.median(host_times):9.3f}")


if __name__ == "__main__":
    main()
