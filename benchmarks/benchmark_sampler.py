"""The sampler's step with and without sampling controls: correctness first, then ms.

One decode step's sampling as ModelRunner.run does it, at batch B (default 256) over a
vocabulary of V logits (default Qwen3's 151,936) in bfloat16: sample/sampling_controls.py
builds the controls' tensors from each row's Sequence (prompt of P tokens, completion of L
so far) on the host, layers/logits_processors.py applies them, the Sampler draws.

Cases (each on every row):
  greedy        temperature 0: one argmax (no controls)
  temperature   temperature 1: on a GPU the Triton kernels (the decode graph's path)
  top_p         top_p 0.9: the PyTorch path's sort
  penalties     presence, frequency and repetition penalties, temperature 1
  logit_bias    16 biased tokens a row, temperature 1
  min_tokens    eos masked (the completion is shorter than min_tokens), temperature 1
  min_p         min_p 0.1, temperature 1
  all           all of the above at once

Columns: correct (the processed logits of 4 rows against a per-row loop of the formulas,
float32, and greedy tokens against their argmax: OK / NO), then host ms (building the
controls' tensors: Python and copies queued) and step ms (host + device: prepare, process,
sample, synchronize; median of --iters).

--quick: tiny shapes on the CPU (timings there are not performance numbers).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny shapes on the CPU")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--vocab", type=int, default=151_936)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--completion-len", type=int, default=256)
    p.add_argument("--iters", type=int, default=50)
    return p.parse_args()


if __name__ == "__main__":
    parse_args()  # --help and bad arguments answer here, before torch's import (seconds)

import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "src")]  # benchmarks.* and myvllm, run as a file too

from benchmarks.device import require_gpu  # noqa: E402
from myvllm import SamplingParams  # noqa: E402
from myvllm.engine.model_runner import prepare_sample  # noqa: E402
from myvllm.sample.sampling_controls import prepare_logits_processing  # noqa: E402
from myvllm.engine.sequence import Sequence  # noqa: E402
from myvllm.worker.staging import FreshTensors  # noqa: E402
from myvllm.layers.logits_processors import process_logits  # noqa: E402
from myvllm.layers.sampler import Sampler  # noqa: E402

EOS = frozenset({0})
CASES: dict[str, dict[str, Any]] = {
    "greedy": dict(temperature=0.0),
    "temperature": dict(temperature=1.0),
    "top_p": dict(temperature=1.0, top_p=0.9),
    "penalties": dict(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.5,
                      repetition_penalty=1.2),
    "logit_bias": dict(temperature=1.0, logit_bias="16 a row"),
    "min_tokens": dict(temperature=1.0, min_tokens="beyond the completion"),
    "min_p": dict(temperature=1.0, min_p=0.1),
    "all": dict(temperature=1.0, top_p=0.9, presence_penalty=0.5, frequency_penalty=0.5,
                repetition_penalty=1.2, logit_bias="16 a row", min_tokens="beyond",
                min_p=0.1),
}


def make_sequences(case: dict[str, Any], batch: int, vocab: int, prompt_len: int,
                   completion_len: int, gen: torch.Generator) -> list[Sequence]:
    seqs = []
    for _ in range(batch):
        params = dict(case)
        if "logit_bias" in params:
            ids = torch.randint(1, vocab, (16,), generator=gen).tolist()
            params["logit_bias"] = {t: 5.0 for t in ids}
        if "min_tokens" in params:
            params["min_tokens"] = completion_len + 1
        params["max_tokens"] = completion_len + 8
        prompt = torch.randint(1, vocab, (prompt_len,), generator=gen).tolist()
        seq = Sequence(prompt, block_size=16, sampling_params=SamplingParams(**params))
        for token in torch.randint(1, vocab, (completion_len,), generator=gen).tolist():
            seq.append_token(token)
        seqs.append(seq)
    return seqs


def reference_row(logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
    """The controls on one row, by a Python loop over its tokens (float32)."""
    row = logits.float().clone()
    p = seq.sampling_params
    for token, bias in (p.logit_bias or {}).items():
        row[token] += bias
    if seq.num_completion_tokens < p.min_tokens:
        for token in EOS | set(p.stop_token_ids or ()):
            row[token] = float("-inf")
    counts = Counter(seq.completion_token_ids)
    for token in set(seq.token_ids):
        if p.repetition_penalty != 1:
            row[token] = (row[token] / p.repetition_penalty if row[token] > 0
                          else row[token] * p.repetition_penalty)
    for token, count in counts.items():
        row[token] -= p.frequency_penalty * count + p.presence_penalty
    return row


def one_step(seqs: list[Sequence], logits: torch.Tensor, fresh: FreshTensors,
             pool: torch.Tensor, sampler: Sampler) -> tuple[torch.Tensor, torch.Tensor]:
    processing = prepare_logits_processing(seqs, fresh.tensor, pool, EOS)
    args = prepare_sample(seqs, fresh.tensor, logits.device)
    processed = logits if processing is None else process_logits(logits, processing)
    tokens = sampler(processed, args.temperatures, args.top_ks, args.top_ps, args.generators,
                     all_greedy=args.all_greedy, min_ps=args.min_ps)
    return processed, tokens


def check(seqs: list[Sequence], logits: torch.Tensor, processed: torch.Tensor,
          tokens: torch.Tensor) -> bool:
    rows = range(min(4, len(seqs)))
    ok = all(torch.allclose(processed[r].float().cpu(), reference_row(logits[r].cpu(), seqs[r]),
                            rtol=1e-5, atol=1e-5) for r in rows)
    if seqs[0].sampling_params.temperature == 0:
        ok = ok and torch.equal(tokens.cpu(), processed.float().argmax(-1).cpu())
    return ok


def main() -> None:
    args = parse_args()
    if args.quick:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        args.batch, args.vocab, args.prompt_len, args.completion_len, args.iters = 8, 1000, 12, 6, 3
    else:
        device = require_gpu(__file__)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    print(f"# batch {args.batch}, vocab {args.vocab}, prompt {args.prompt_len}, completion "
          f"{args.completion_len}, {dtype}, {device}")
    print(f"{'case':<12} {'correct':>7} {'host ms':>8} {'step ms':>8}")
    gen = torch.Generator().manual_seed(0)
    fresh = FreshTensors(device)
    pool = torch.zeros(args.batch, dtype=torch.int64, device=device)
    sampler = Sampler()
    logits = (torch.randn(args.batch, args.vocab, generator=gen) * 3).to(device, dtype)
    for name, case in CASES.items():
        seqs = make_sequences(case, args.batch, args.vocab, args.prompt_len,
                              args.completion_len, gen)
        processed, tokens = one_step(seqs, logits, fresh, pool, sampler)  # warm-up, checked
        ok = check(seqs, logits, processed, tokens)
        host, step = [], []
        for _ in range(args.iters):
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            prepare_logits_processing(seqs, fresh.tensor, pool, EOS)
            host.append(time.perf_counter() - start)
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            one_step(seqs, logits, fresh, pool, sampler)
            if device.type == "cuda":
                torch.cuda.synchronize()
            step.append(time.perf_counter() - start)
        print(f"{name:<12} {'OK' if ok else 'NO':>7} {statistics.median(host) * 1e3:8.3f} "
              f"{statistics.median(step) * 1e3:8.3f}")


if __name__ == "__main__":
    main()
