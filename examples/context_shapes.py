"""Print the tensors that InputBuilder.prepare_prefill / prepare_decode build for a small batch.

    uv run python examples/context_shapes.py
    uv run python examples/context_shapes.py --block-size 2

No model is loaded: the InputBuilder (worker/input_builder.py) only reads the sequences
(token ids, block tables, num_cached_tokens) and the block size, so the script builds one
alone and calls the real methods.

The batch: an earlier request X = P + [90] has finished, leaving the blocks of the 8-token
prefix P hashed in the cache. Then A = P + [a1, a2, a3] and B = [b0 .. b4] are prefilled
together: A hits the cache for 8 tokens, B is cold. After one fake token each, one decode step.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))  # run without install


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--block-size", type=int, default=4)
    return parser.parse_args(argv)


if __name__ == "__main__":
    parse_args()  # --help and bad arguments answer here, before torch's import (seconds)

import torch  # noqa: E402

from myvllm.config import Config  # noqa: E402
from myvllm.worker.input_builder import InputBuilder  # noqa: E402
from myvllm.engine.scheduler import Scheduler  # noqa: E402
from myvllm.engine.sequence import Sequence  # noqa: E402
from myvllm.sampling_parameters import SamplingParams  # noqa: E402

P = [11, 12, 13, 14, 15, 16, 17, 18]
A_TAIL = [21, 22, 23]
B = [31, 32, 33, 34, 35]


def input_builder(block_size: int) -> InputBuilder:
    """What the ModelRunner uses to build a step's tensors. On a CPU it does not pad decode
    batches to CUDA-graph sizes (see exercises.py)."""
    return InputBuilder(Config(device="cpu", block_size=block_size, max_model_length=64,
                               max_num_sequences=8))


def show(name: str, value: object) -> None:
    if isinstance(value, torch.Tensor):
        text = str(value.tolist())
        dtype = str(value.dtype).replace("torch.", "")
        print(f"  {name:<13} {text:<44} {tuple(value.shape)} {dtype}")
    else:
        print(f"  {name:<13} {value}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    bs = args.block_size

    sch = Scheduler(Config(num_kvcache_blocks=16, block_size=bs, max_model_length=64, eos=-1))
    greedy = SamplingParams(temperature=0.0, max_tokens=4)
    x = Sequence(P + [90], bs, SamplingParams(max_tokens=1))
    sch.add_sequence(x)
    sch.postprocess(*[sch.schedule()[0], [91]])  # X: prefilled, one token, finished
    a, b = Sequence(P + A_TAIL, bs, greedy), Sequence(B, bs, greedy)
    sch.add_sequence(a)
    sch.add_sequence(b)
    seqs, is_prefill = sch.schedule()
    assert is_prefill and seqs == [a, b]
    inputs = input_builder(bs)

    print(f"block_size={bs}.  Finished earlier: X = P + [90], P = {P}")
    print(f"A = P + {A_TAIL}: {len(a)} tokens, num_cached_tokens={a.num_cached_tokens}, "
          f"block_table={a.block_table}")
    print(f"B = {B}: {len(b)} tokens, num_cached_tokens={b.num_cached_tokens}, "
          f"block_table={b.block_table}")
    step = inputs.prepare_prefill(seqs)
    print("\nprepare_prefill([A, B])   (only the uncached tokens are fed to the model)")
    show("input_ids", step.input_ids)
    show("positions", step.positions)
    for key in ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k",
                "slot_mapping", "block_tables"):
        show(key, getattr(step.context, key))
    cu_q = step.context.cu_seqlens_q
    assert isinstance(cu_q, torch.Tensor)
    show("LM-head rows", cu_q[1:] - 1)
    print("  (ParallelLMHead keeps rows cu_seqlens_q[1:] - 1: the last token of each sequence)")

    sch.postprocess(seqs, [41, 51])  # the 'model' sampled 41 for A and 51 for B
    seqs, is_prefill = sch.schedule()
    assert not is_prefill
    step = inputs.prepare_decode(seqs)
    print(f"\nprepare_decode([A, B])   A: {len(a)} tokens, table {a.block_table}; "
          f"B: {len(b)} tokens, table {b.block_table}")
    show("input_ids", step.input_ids)
    show("positions", step.positions)
    for key in ("slot_mapping", "context_lens", "block_tables"):
        show(key, getattr(step.context, key))
    print("  (-1 pads the block tables to a rectangle; the kernels never read past context_lens)")


if __name__ == "__main__":
    main()
