"""Watch the real Scheduler and BlockManager work, one step at a time, with no model at all.

    uv run python examples/scheduler_trace.py            # the default story (below)
    uv run python examples/scheduler_trace.py --help     # knobs: block size, pool size, ...
    uv run python examples/scheduler_trace.py --overlap  # the same with async scheduling
    uv run python examples/scheduler_trace.py --chunked  # the token budget (chunked prefill)

The engine's loop is three calls (LLMEngine.step):

    seqs, is_prefill = scheduler.schedule()
    token_ids = model_runner.run(seqs, is_prefill)    <- here a fake token source instead
    scheduler.postprocess(seqs, token_ids)

Only the middle call needs a model, and the scheduler never looks inside the tokens, so this
script replaces it with a counter and prints what the two bookkeeping classes decide. The
default story, with a deliberately tiny KV pool:

    step 1   A and B arrive; they share an 8-token prefix. Both are prefilled in one batch,
             and B already hits the two prefix blocks that A's allocate() just registered.
    step 3   C arrives while A and B are decoding: prefill first, so A and B skip a step.
    later    the pool runs dry: the TAIL of `running` is preempted (recompute) and comes back.
    end      A, B, C have finished; D arrives with the same prefix and is served from
             blocks that are free but still hashed (prefix caching across requests).

With --chunked the scheduler works by a budget of max_num_batched_tokens (6 here) per step:
running sequences decode first, then prompts fill what is left, in chunks; a prompt
part-way through its prefill goes on in the next step, and only the step with its last
chunk samples a token. The engine itself runs that mode by default
(Config.enable_chunked_prefill); the default story above shows the prefill-first rules.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))  # run without install

from myvllm.config import Config  # noqa: E402
from myvllm.engine.scheduler import Scheduler  # noqa: E402
from myvllm.engine.sequence import Sequence  # noqa: E402
from myvllm.sampling_parameters import SamplingParams  # noqa: E402
from myvllm.worker.pending_tokens import add_pending_token  # noqa: E402

PREFIX = [10, 11, 12, 13, 14, 15, 16, 17]  # two full blocks of 4: shareable


class TracingScheduler(Scheduler):
    """The real Scheduler; only preempt() is wrapped, to record who was sent back."""

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.preempted_now: list[Sequence] = []

    def preempt(self, seq: Sequence) -> None:
        self.preempted_now.append(seq)
        super().preempt(seq)


def fake_token(seq: Sequence) -> int:
    """The 'model': completion token number n of a sequence is 100 + n. Deterministic, so a
    preempted sequence produces the same tokens when it runs again."""
    return 100 + seq.num_completion_tokens


def show_blocks(sch: Scheduler, names: dict[int, str]) -> None:
    bm = sch.block_manager
    width = max(3, len(str(len(bm.blocks) - 1)) + 1)
    cell = lambda s: f"{s:>{width}}"  # noqa: E731
    print("    block   " + "".join(cell(b.block_id) for b in bm.blocks))
    print("    ref     " + "".join(cell(b.ref_count) for b in bm.blocks))
    print("    hashed  " + "".join(cell("h" if b.hash != -1 else ".") for b in bm.blocks))
    print(f"    free list (handed out from the left): {list(bm.free_block_ids)}")
    for seq in list(sch.running) + list(sch.waiting):
        where = "running" if seq in sch.running else "waiting"
        pending = f" ({seq.num_pending_tokens} pending)" if seq.num_pending_tokens else ""
        print(f"    {names[seq.seq_id]}: {where:7}  tokens={seq.num_tokens:<3} "
              f"block_table={seq.block_table}{pending}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--block-size", type=int, default=4)
    parser.add_argument("--num-blocks", type=int, default=8, help="KV-cache blocks in the pool")
    parser.add_argument("--max-num-sequences", type=int, default=4)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="the step's token budget (default: 64, or 6 with --chunked)")
    parser.add_argument("--max-tokens", type=int, default=6, help="completion tokens per request")
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--overlap", action="store_true",
                        help="as async scheduling does: schedule step N+1 before step N's "
                             "tokens are read back (they count as pending meanwhile)")
    parser.add_argument("--chunked", action="store_true",
                        help="chunked prefill: decode rows first, then prompt chunks fill "
                             "the token budget")
    args = parser.parse_args(argv)
    if args.max_num_batched_tokens is None:
        args.max_num_batched_tokens = 6 if args.chunked else 64

    config = Config(num_kvcache_blocks=args.num_blocks, block_size=args.block_size,
                    max_num_sequences=args.max_num_sequences,
                    max_num_batched_tokens=args.max_num_batched_tokens,
                    max_model_length=64, eos=-1,  # no eos: requests stop at max_tokens
                    enable_prefix_caching=not args.no_prefix_caching,
                    enable_chunked_prefill=args.chunked)
    sch = TracingScheduler(config)
    params = SamplingParams(max_tokens=args.max_tokens)
    # step -> requests arriving just before that step's schedule()
    arrivals: dict[int, list[tuple[str, list[int]]]] = {
        1: [("A", PREFIX + [1]), ("B", PREFIX + [2, 3])],
        3: [("C", [30, 31, 32, 33, 34, 35])],
    }
    late = ("D", PREFIX + [4, 5])  # arrives once everything else has finished
    names: dict[int, str] = {}
    print(f"KV pool: {args.num_blocks} blocks of {args.block_size} tokens; "
          f"max_num_sequences={args.max_num_sequences}, "
          f"max_num_batched_tokens={args.max_num_batched_tokens}; "
          f"every request generates {args.max_tokens} tokens\n")

    step = 0
    in_flight: tuple[int, list[Sequence], list[int]] | None = None  # --overlap: not read yet
    while True:
        step += 1
        new = arrivals.pop(step, [])
        if sch.is_finished() and not arrivals and in_flight is None:
            if late is None:
                break
            new, late = [late], None
        for name, tokens in new:
            seq = Sequence(tokens, config.block_size, params)
            names[seq.seq_id] = name
            sch.add_sequence(seq)
            print(f"-- {name} arrives: {len(tokens)} prompt tokens {tokens}")
        running_before = [names[s.seq_id] for s in sch.running]

        sch.preempted_now.clear()
        seqs, is_prefill = sch.schedule()
        kind = "PREFILL" if is_prefill else "DECODE"
        if args.chunked:
            kind = "MIXED" if is_prefill else "DECODE"
        if seqs:
            print(f"step {step}: {kind} batch={[names[s.seq_id] for s in seqs]}")
        else:  # only with --overlap: what can run next depends on the step in flight
            print(f"step {step}: nothing to schedule before the step in flight is read back")
        if args.chunked:
            for seq in seqs:
                start = seq.num_computed_tokens - seq.num_new_tokens
                what = ("decode" if seq.num_new_tokens == 1 and start == len(seq) - 1
                        else f"prompt chunk [{start}, {seq.num_computed_tokens}) of "
                             f"{seq.num_tokens}")
                hit = (f", cache hit {seq.num_cached_tokens}"
                       if start == seq.num_cached_tokens and seq.num_cached_tokens else "")
                samples = "samples" if seq.num_computed_tokens == len(seq) else "no token yet"
                print(f"    {names[seq.seq_id]}: {what}{hit}: {samples}")
            print(f"    tokens computed: {sum(s.num_new_tokens for s in seqs)} of "
                  f"{args.max_num_batched_tokens}")
        elif is_prefill:
            for seq in seqs:
                computed = seq.num_tokens - seq.num_cached_tokens
                print(f"    {names[seq.seq_id]}: cache hit {seq.num_cached_tokens} tokens, "
                      f"computes {computed}")
            skipped = [n for n in running_before if n not in {names[s.seq_id] for s in seqs}]
            if skipped:
                print(f"    prefill first: {skipped} skip their decode this step")
        for victim in sch.preempted_now:
            print(f"    PREEMPTED {names[victim.seq_id]} (tail of running): blocks freed, "
                  f"back to the front of waiting with {victim.num_tokens} tokens to recompute")
        # Chunked prefill: only a sequence whose chunk reached its last token samples.
        seqs = [s for s in seqs if not args.chunked or s.num_computed_tokens == len(s)]
        tokens = [fake_token(s) for s in seqs]  # what the model would sample in this step
        if args.overlap:
            # Queue this step, then read back the previous one: until then its tokens are
            # pending, counted in num_tokens (the plan above used them) but not yet known.
            for seq in seqs:
                add_pending_token(seq)
            if seqs:
                pending = [names[s.seq_id] for s in seqs]
                print(f"    queued; pending tokens for {pending} until the next step reads them")
            done, in_flight = in_flight, (step, seqs, tokens) if seqs else None
            if done is None:
                show_blocks(sch, names)
                print()
                continue
            done_step, seqs, tokens = done
            print(f"    read back step {done_step}: tokens {tokens}")
        finished = sch.postprocess(seqs, tokens)
        for seq in finished:
            print(f"    {names[seq.seq_id]} finished: completion {seq.completion_token_ids}")
        show_blocks(sch, names)
        print()
    bm = sch.block_manager
    print(f"done after {step - 1} steps; free blocks {len(bm.free_block_ids)} of {len(bm.blocks)},"
          f" used {sorted(b.block_id for b in bm.blocks if b.ref_count > 0)}")


if __name__ == "__main__":
    main()
