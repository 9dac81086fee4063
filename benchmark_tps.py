"""End-to-end offline throughput: myvllm against HF transformers on the nano-vllm workload.

Workload (nano-vllm's bench.py): 256 sequences, prompt token ids random in [0, 10000) with
lengths uniform in 100..1024, max_tokens uniform in 100..1024, ignore_eos, temperature 0.6,
Python's random seeded with 0. Throughput = requested completion tokens / wall time.

Weights: real weights cannot be fetched on our machines, and speed does not depend on the
weights' values, only on their shapes. By default the benchmark builds the Qwen3-0.6B
architecture from configs/Qwen3-0.6B/config.json (the hub's config.json) with random weights,
saves it as safetensors, and both engines load that checkpoint, so their greedy tokens can be
compared. --model configs/NAME (a folder holding only config.json: Qwen3-8B, Qwen3-30B-A3B,
...) runs myvllm with load_format="dummy" instead: random weights made in place, nothing
written or read, so large shapes start in seconds; transformers then gets its own random
weights of the same config and there is no token comparison. --load-format dummy does the same
for the default Qwen3-0.6B config. --model may also name a real checkpoint.

Order of work: correctness first (greedy tokens of myvllm vs transformers on the same
checkpoint; a mismatch means no timing is printed for myvllm), then throughput, then
batch-1 decode latency (context 128, CUDA graphs), then a PNG plot.

HF transformers runs a subset (--hf-num-seqs, default 64) in static batches: it has no
continuous batching, so a batch runs until its longest request is done. Its tok/s counts
only the tokens that were asked for, like myvllm's.

When the vllm package is importable (it is not a dependency), the same workload also runs
on vLLM after the other two.

--quick: a tiny random Qwen3 on the CPU, a handful of short sequences (CI smoke test).

--batch-invariant: the same runs with Config.batch_invariant=True (kernels that reduce in an
order independent of the batch), for its cost in throughput and at batch 1.

--bundled: the CPU comparison (docs/benchmarks.md): the bundled SmolLM2-135M-Instruct (real
weights, GGUF), 4 chat prompts x 64 greedy tokens (--bundled-max-tokens N for another count),
myvllm against transformers loading the same GGUF file (batched with left padding), fp32, both
timed after one warm-up run.

Those two are the CPU modes: without a GPU, any other run stops at once with a hint naming them.

--input-len N / --output-len N: every prompt N tokens, every request N output tokens, instead
of the uniform ranges (the long-context workload: --num-seqs 64 --input-len 8000 --output-len
512 --skip-hf). --num-kvcache-blocks N gives every engine the same cache, whatever its dtype.

--kv-cache-dtype auto,fp8: the KV cache's dtype (Config.kv_cache_dtype); with two, the
workload runs on an engine of each in turn, in this one process, and the second engine's
throughput is printed beside the first's (its block count, each run, the ratio of medians).
With --bundled, the second engine's greedy tokens and their logprobs are compared with the
first's instead (how far an fp8 cache moves real weights' outputs).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent


def kv_cache_dtypes(text: str) -> list[str]:
    """--kv-cache-dtype: one or two of Config's KV_CACHE_DTYPES, comma-separated."""
    allowed = ("auto", "fp8")  # Config's KV_CACHE_DTYPES (importing myvllm here loads torch)
    names = text.split(",")
    if not 1 <= len(names) <= 2 or len(set(names)) != len(names) or not set(names) <= set(allowed):
        raise argparse.ArgumentTypeError(f"expected one or two different values of {allowed}, "
                                         f"comma-separated, got {text!r}")
    return names


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny CPU smoke run (for CI)")
    parser.add_argument("--bundled", action="store_true",
                        help="the CPU target: bundled SmolLM2, 4 prompts x 64 tokens vs HF")
    parser.add_argument("--bundled-max-tokens", type=int, default=64, metavar="N",
                        help="tokens per prompt in --bundled (default 64, the recorded "
                             "comparison; the tests run a shorter one)")
    parser.add_argument("--model",
                        help="a checkpoint, or configs/NAME (a folder with config.json only: "
                             "dummy weights of that shape)")
    parser.add_argument("--load-format", choices=("auto", "dummy"), default=None,
                        help="dummy: random weights from config.json, no checkpoint read "
                             "(default: dummy for a folder holding config.json and no "
                             "weights, else auto)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--max-input-len", type=int, default=1024)
    parser.add_argument("--max-output-len", type=int, default=1024)
    parser.add_argument("--input-len", type=int, default=None, metavar="N",
                        help="every prompt N tokens (default: uniform in 100..--max-input-len)")
    parser.add_argument("--output-len", type=int, default=None, metavar="N",
                        help="every request N output tokens (default: uniform in "
                             "100..--max-output-len)")
    parser.add_argument("--num-kvcache-blocks", type=int, default=None, metavar="N",
                        help="Config.num_kvcache_blocks: N blocks for every engine, whatever "
                             "its cache dtype (default: as many as fit the memory budget)")
    parser.add_argument("--hf-num-seqs", type=int, default=64)
    parser.add_argument("--hf-batch-size", type=int, default=64)
    parser.add_argument("--skip-hf", action="store_true",
                        help="no transformers run (its MoE models loop over the experts: slow)")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--batch-invariant", action="store_true",
                        help="Config.batch_invariant: every kernel reduces in a fixed order "
                             "(its throughput cost; docs/reliability.md)")
    parser.add_argument("--disable-custom-all-reduce", action=argparse.BooleanOptionalAction,
                        default=True,
                        help="Config.disable_custom_all_reduce (default on: NCCL for every "
                             "tensor-parallel all-reduce); --no-disable-custom-all-reduce "
                             "lets the small ones use the symmetric-memory kernel")
    parser.add_argument("--kv-cache-dtype", type=kv_cache_dtypes, default=["auto"],
                        metavar="DTYPE[,DTYPE]",
                        help="the KV cache's dtype, auto (the model's) or fp8; two, e.g. "
                             "auto,fp8, run the workload on one engine of each and compare")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="the engine's token budget per step (default: Config's)")
    parser.add_argument("--max-prefill-tokens-while-decoding", type=int, default=None,
                        help="prompt tokens a step may add beside decode rows (default: "
                             "Config's; 0 = no cap)")
    parser.add_argument("--no-chunked-prefill", action="store_true",
                        help="prefill-first scheduling instead of chunked prefill")
    async_group = parser.add_mutually_exclusive_group()
    async_group.add_argument("--no-async-scheduling", action="store_true",
                             help="read each step's tokens before planning the next one")
    async_group.add_argument("--async-scheduling", action="store_true",
                             help="plan the next step before this step's tokens are read (the "
                                  "default on a GPU; this flag turns it on on a CPU too)")
    parser.add_argument("--runs", type=int, default=2, metavar="N",
                        help="timed runs of the workload in one process, each on fresh prompts "
                             "(default 2); with N > 2 the median, minimum and maximum are printed")
    parser.add_argument("--plot", default=str(REPO / "docs" / "benchmark_tps.png"))
    parser.add_argument("--json", help="write the results here as JSON")
    parser.add_argument("--timeline", metavar="FILE",
                        help="after the throughput run, run the workload again one step at a "
                             "time, time each phase of every step, print a summary by batch "
                             "size and write the steps to FILE as JSON")
    parser.add_argument("--profile", type=int, default=0, metavar="STEPS",
                        help="after the throughput run, profile STEPS decode steps at the full "
                             "batch with torch.profiler and print where the time goes")
    args = parser.parse_args()
    if args.bundled_max_tokens < 1:
        parser.error(f"--bundled-max-tokens must be >= 1, got {args.bundled_max_tokens}")
    for flag in ("input_len", "output_len", "num_kvcache_blocks"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    # Fixed lengths: the workload's range collapses to one value (and sizes max_model_length).
    if args.input_len is not None:
        args.max_input_len = args.input_len
    if args.output_len is not None:
        args.max_output_len = args.output_len
    if not 2 <= args.runs <= 15:
        # Each run XORs the prompts' token ids with its number, so the number stays small.
        parser.error(f"--runs must be between 2 and 15, got {args.runs}")
    return args


if __name__ == "__main__":
    parse_args()  # --help and bad arguments answer here, before torch's import (seconds)

import torch  # noqa: E402

sys.path.insert(0, str(REPO / "src"))  # run from a checkout without installing

from benchmarks.device import require_gpu  # noqa: E402
from benchmarks.workload import (  # noqa: E402
    QWEN3_CONFIG,
    batch1_ms_per_token,
    fresh_copy,
    holds_only_a_config,
    make_workload,
    pick_model,
)


def random_hf_model(path: Path, dtype: torch.dtype, device: str):
    """transformers' model of path's config.json with its own random weights, made on device."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=dtype)
    return model.eval()


def hf_generate(model, prompts: list[list[int]], max_new: int, greedy: bool,
                pad_id: int) -> list[list[int]]:
    """Left-padded static batch, exactly max_new new tokens per row (eos ignored)."""
    device = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new,
                         min_new_tokens=max_new, do_sample=not greedy,
                         temperature=None if greedy else 0.6, top_p=None, top_k=None,
                         pad_token_id=pad_id, eos_token_id=None)
    return out[:, width:].tolist()


BUNDLED_PROMPTS = [
    "What is the capital of France?",
    "List three prime numbers.",
    "Write one sentence about the sea.",
    "Explain gravity in one line.",
]


def run_bundled(kv_dtypes: list[str], max_tokens: int = 64) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from myvllm import LLM, SamplingParams
    from myvllm.utils.model_path import bundled_model_path

    llm = LLM(None, device="cpu", kv_cache_dtype=kv_dtypes[0])
    chats = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                               add_generation_prompt=True)
             for p in BUNDLED_PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    gguf = Path(bundled_model_path())
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.padding_side = "left"
    hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                              dtype=torch.float32).eval()
    batch = tokenizer(chats, return_tensors="pt", padding=True, add_special_tokens=False)

    def run_hf() -> list[list[int]]:
        with torch.inference_mode():
            out = hf.generate(**batch, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                              do_sample=False, pad_token_id=tokenizer.pad_token_id or 0)
        return out[:, batch.input_ids.shape[1]:].tolist()

    def timed(fn):
        fn()  # warm-up
        start = time.perf_counter()
        result = fn()
        return result, time.perf_counter() - start

    ours, ours_s = timed(lambda: [o["token_ids"] for o in
                                  llm.generate(chats, params, use_tqdm=False)])
    theirs, theirs_s = timed(run_hf)
    # transformers' min_new_tokens forbids eos, ignore_eos only ignores it: compare each
    # completion up to its first eos, where both are plain greedy decoding.
    eos = tokenizer.eos_token_id
    spans = [x.index(eos) if eos in x else len(x) for x in ours]
    correct = all(x[:n] == y[:n] for x, y, n in zip(ours, theirs, spans))
    print(f"correctness: greedy tokens up to the first eos ({spans}) equal to transformers: "
          f"{correct} -> {'OK' if correct else 'NO'}")
    if correct:
        print(f"myvllm:       {ours_s:.2f} s for {len(chats)} prompts x {max_tokens} tokens")
    print(f"transformers: {theirs_s:.2f} s (batched, left padding)")
    if correct:
        print(f"ratio:        {theirs_s / ours_s:.2f}x (transformers time / myvllm time)")
    if len(kv_dtypes) > 1:
        compare_greedy_kv_cache_dtypes(llm, chats, kv_dtypes, max_tokens)
    llm.exit()


def compare_greedy_kv_cache_dtypes(llm, chats: list[str], kv_dtypes: list[str],
                                   max_tokens: int) -> None:
    """Greedy tokens of an engine with the second KV-cache dtype against llm's (the first):
    tokens equal position by position, where the first differs, and while they agree the
    |difference| of the chosen tokens' logprobs."""
    from myvllm import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                            logprobs=0)

    def greedy(engine) -> list[tuple[list[int], list[float]]]:
        outs = engine.generate(chats, params, use_tqdm=False)
        return [(o["token_ids"], [lp[t] for lp, t in zip(o["logprobs"], o["token_ids"])])
                for o in outs]

    first = greedy(llm)
    other = LLM(llm.config.model, device=llm.config.device, kv_cache_dtype=kv_dtypes[1])
    second = greedy(other)
    other.exit()
    equal = sum(a == b for (x, _), (y, _) in zip(first, second) for a, b in zip(x, y))
    diverge = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x))
               for (x, _), (y, _) in zip(first, second)]
    errors = [abs(a - b) for (_, la), (_, lb), n in zip(first, second, diverge)
              for a, b in zip(la[:n], lb[:n])] or [float("nan")]  # nan: every first token differs
    print(f"kv cache {kv_dtypes[1]} vs {kv_dtypes[0]}: greedy tokens equal {equal}/"
          f"{len(chats) * max_tokens}, first difference at {diverge} (of {max_tokens}); "
          f"|logprob difference| of the chosen tokens before it: mean "
          f"{statistics.mean(errors):.4f}, max {max(errors):.4f}")


def main() -> None:
    args = parse_args()
    if args.bundled:
        run_bundled(args.kv_cache_dtype, args.bundled_max_tokens)
        return

    from transformers import AutoModelForCausalLM

    from myvllm import LLM, SamplingParams

    # --quick and --bundled are the CPU modes; the full workload on a CPU would run for
    # tens of minutes, so without a GPU the script stops and names them.
    device = "cpu" if args.quick else require_gpu(__file__, "--quick or --bundled").type
    if args.quick:
        args.num_seqs, args.max_input_len, args.max_output_len = 6, 24, 24
        args.hf_num_seqs, args.hf_batch_size, min_len = 3, 3, 8
    else:
        min_len = 100
    results: dict[str, object] = {"device": torch.cuda.get_device_name() if device == "cuda"
                                  else "cpu", "torch": torch.__version__}

    with tempfile.TemporaryDirectory() as tmp:
        path, load_format = pick_model(args, Path(tmp), device)
        dummy = load_format == "dummy"
        results["model"] = (Path(args.model).name if args.model else
                            "tiny Qwen3" if args.quick else QWEN3_CONFIG.parent.name)
        results["load_format"] = load_format
        dtype = torch.float32 if args.quick else torch.bfloat16
        # With a checkpoint, transformers loads it now, for the token comparison; with dummy
        # weights there is nothing to compare, and it is built after myvllm has exited.
        hf = (None if dummy else
              AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval())
        # 0.6 of the GPU for myvllm (weights, activations, KV cache) leaves room for the
        # transformers model loaded beside it; a dummy run frees the GPU before transformers.
        settings = dict(
            load_format=load_format, enforce_eager=args.enforce_eager,
            batch_invariant=args.batch_invariant,
            disable_custom_all_reduce=args.disable_custom_all_reduce,
            gpu_memory_utilization=0.9 if hf is None else 0.6,
            tensor_parallel_size=args.tensor_parallel_size,
            async_scheduling=(False if args.no_async_scheduling else
                              True if args.async_scheduling else None),
            # The batch-1 measurement asks for 129 tokens after a prompt of up to 128.
            max_model_length=max(args.max_input_len + args.max_output_len, 128 + 129),
            **({"num_kvcache_blocks": args.num_kvcache_blocks} if args.num_kvcache_blocks
               else {}),
            max_num_sequences=256 if not args.quick else 8,
            enable_chunked_prefill=not args.no_chunked_prefill,
            **({"max_prefill_tokens_while_decoding": args.max_prefill_tokens_while_decoding}
               if args.max_prefill_tokens_while_decoding is not None else {}),
            **({"max_num_batched_tokens": args.max_num_batched_tokens}
               if args.max_num_batched_tokens else
               {"max_num_batched_tokens": 512} if args.quick else {}))
        llm = LLM(str(path), kv_cache_dtype=args.kv_cache_dtype[0], **settings)
        first_blocks = llm.config.num_kvcache_blocks
        vocab = min(llm.vocab_size, 10000)

        # 1. Correctness: greedy tokens against transformers on the same checkpoint.
        correct: bool | None = None
        if hf is None:
            print("correctness: not checked (dummy weights: transformers has no checkpoint "
                  "to load the same weights from)")
        else:
            check_prompts, _ = make_workload(4, 16, 32, 16, vocab)
            n_check = 8
            ours = [o["token_ids"] for o in llm.generate(
                check_prompts,
                SamplingParams(temperature=0.0, max_tokens=n_check, ignore_eos=True),
                use_tqdm=False)]
            theirs = [hf_generate(hf, [p], n_check, greedy=True, pad_id=0)[0]
                      for p in check_prompts]
            agree = sum(a == b for x, y in zip(ours, theirs) for a, b in zip(x, y))
            first_ok = all(x[0] == y[0] for x, y in zip(ours, theirs))
            # bf16 random-weight logits are close to ties, so later tokens may drift; the first
            # token of every prompt and most of the rest must agree.
            correct = first_ok and agree >= 0.75 * n_check * len(check_prompts)
            print(f"correctness: greedy tokens equal to transformers: {agree}/"
                  f"{n_check * len(check_prompts)}, first tokens all equal: {first_ok} -> "
                  f"{'OK' if correct else 'NO'}")
        results["correct"] = correct
        reported = correct is not False  # a failed comparison withholds the timings

        # 2. Throughput.
        prompts, max_tokens = make_workload(
            args.num_seqs, args.input_len or min_len, args.max_input_len, args.max_output_len,
            vocab, min_output=args.output_len or min_len)
        params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n)
                  for n in max_tokens]
        llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        ours_tps = sum(max_tokens) / elapsed
        if reported:
            print(f"myvllm:       {sum(max_tokens)} tokens in {elapsed:.2f} s = "
                  f"{ours_tps:,.0f} output tok/s ({args.num_seqs} sequences)")
        else:
            print("myvllm:       throughput not reported: the correctness check failed")
        results["myvllm_tok_s"] = ours_tps if reported else None
        # The first run also pays for anything done once per process (e.g. Triton compiling
        # a kernel variant met for the first time); a second run shows the steady state.
        start = time.perf_counter()
        llm.generate(fresh_copy(prompts), params, use_tqdm=False)
        second_tps = sum(max_tokens) / (time.perf_counter() - start)
        if reported:
            print(f"myvllm:       {second_tps:,.0f} output tok/s in a second run (fresh prompts)")
        results["myvllm_second_run_tok_s"] = second_tps if reported else None
        all_runs = [ours_tps, second_tps]
        if args.runs > 2:
            for key in later_run_keys(args.runs):
                start = time.perf_counter()
                llm.generate(fresh_copy(prompts, key=key), params, use_tqdm=False)
                all_runs.append(sum(max_tokens) / (time.perf_counter() - start))
            ranked = sorted(all_runs)
            if reported:
                print(f"myvllm:       {args.runs} runs: median {statistics.median(ranked):,.0f}, "
                      f"min {ranked[0]:,.0f}, max {ranked[-1]:,.0f} output tok/s (each: "
                      f"{', '.join(f'{t:,.0f}' for t in all_runs)})")
            results["myvllm_runs_tok_s"] = all_runs if reported else None

        if args.timeline:
            step_timeline(llm, prompts, params, device, Path(args.timeline))
        if args.profile:
            profile_decode(llm, prompts, params, args.profile, device)

        # 3. Batch-1 decode latency at context 128: (129 tokens - 1 token) / 128, the median
        # of five repeats (single runs varied by ~5% on the H200 machine).
        prompt = prompts[0][:128]
        ms_per_token, fastest, slowest = batch1_ms_per_token(llm, prompt)
        print(f"batch-1 decode: {ms_per_token:.3f} ms/token (context 128, "
              f"{'eager' if llm.model_runner.enforce_eager else 'CUDA graphs'}; median of "
              f"5, range {fastest:.3f}-{slowest:.3f})")
        results["batch1_ms_per_token"] = ms_per_token
        if args.profile:
            sp = SamplingParams(temperature=0.0, max_tokens=args.profile + 8, ignore_eos=True)
            profile_decode(llm, [prompt], [sp], args.profile, device)
        if device == "cuda":
            results["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
            print(f"peak memory: {results['peak_memory_gib']:.1f} GiB "
                  "(includes the KV cache, sized to gpu_memory_utilization)")
        llm.exit()
        del llm  # free the KV cache and graphs before transformers runs on the same GPU
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
        if len(args.kv_cache_dtype) > 1:
            results["kv_cache_dtypes"] = compare_kv_cache_dtypes(
                path, settings, args.kv_cache_dtype, first_blocks, all_runs, prompts, params,
                sum(max_tokens), args.runs, reported)

        # 4. transformers on a subset of the same workload.
        hf_tps = None
        if not args.skip_hf:
            if hf is None:
                hf = random_hf_model(path, dtype, device)  # speed does not depend on values
            subset = list(range(min(args.hf_num_seqs, args.num_seqs)))
            hf_generate(hf, prompts[:2], 4, greedy=False, pad_id=0)  # warm-up
            start = time.perf_counter()
            for b in range(0, len(subset), args.hf_batch_size):
                batch = subset[b:b + args.hf_batch_size]
                hf_generate(hf, [prompts[i] for i in batch], max(max_tokens[i] for i in batch),
                            greedy=False, pad_id=0)
            if device == "cuda":
                torch.cuda.synchronize()
            hf_elapsed = time.perf_counter() - start
            hf_tokens = sum(max_tokens[i] for i in subset)
            hf_tps = hf_tokens / hf_elapsed
            print(f"transformers: {hf_tokens} tokens in {hf_elapsed:.2f} s = {hf_tps:,.0f} "
                  f"output tok/s (first {len(subset)} sequences, static batches of "
                  f"{args.hf_batch_size})")
            if reported:
                print(f"ratio:        {ours_tps / hf_tps:.1f}x")
        results["hf_tok_s"] = hf_tps
        if device == "cuda" and importlib.util.find_spec("vllm") is not None:
            results["vllm_tok_s"] = run_vllm(path, load_format, prompts, max_tokens,
                                             args.max_input_len + args.max_output_len)


    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    if not args.quick:
        plot(results, Path(args.plot))


def later_run_keys(runs: int) -> range:
    """The workload keys (fresh_copy) of timed runs 3..N: 0 and 1 are runs 1 and 2, 2 is the
    timeline's, so every run meets prompts the prefix cache has not seen."""
    return range(3, runs + 1)


def compare_kv_cache_dtypes(path: Path, settings: dict, kv_dtypes: list[str], first_blocks: int,
                            first_runs: list[float], prompts: list[list[int]], params: list,
                            num_tokens: int, runs: int, reported: bool) -> dict[str, object]:
    """The throughput workload again on an engine whose KV cache has the second dtype (the
    first engine has exited): the same runs on the same prompts, then both side by side."""
    import torch

    from myvllm import LLM

    llm = LLM(str(path), kv_cache_dtype=kv_dtypes[1], **settings)
    blocks = llm.config.num_kvcache_blocks
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    tok_s = []
    for key in [0, 1, *later_run_keys(runs)]:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        llm.generate(fresh_copy(prompts, key), params, use_tqdm=False)  # key 0: as given
        tok_s.append(num_tokens / (time.perf_counter() - start))
    llm.exit()
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    ratio = statistics.median(tok_s) / statistics.median(first_runs)
    if reported:
        for name, n, each in ((kv_dtypes[0], first_blocks, first_runs),
                              (kv_dtypes[1], blocks, tok_s)):
            print(f"kv cache {name:>5}: {n} blocks, median {statistics.median(each):,.0f} "
                  f"output tok/s over {len(each)} runs (each: "
                  f"{', '.join(f'{t:,.0f}' for t in each)})")
        print(f"kv cache {kv_dtypes[1]} / {kv_dtypes[0]}: {ratio:.2f}x output tok/s (medians), "
              f"{blocks / first_blocks:.2f}x blocks")
    return {"dtypes": kv_dtypes, "blocks": [first_blocks, blocks],
            "runs_tok_s": [first_runs, tok_s] if reported else None, "ratio": ratio}


def run_vllm(path: Path, load_format: str, prompts: list[list[int]], max_tokens: list[int],
             max_model_len: int) -> float:
    """The same workload on vLLM, only when it is installed (it is not a dependency)."""
    gc.collect()  # vLLM sizes its cache from free memory: release what we can first
    torch.cuda.empty_cache()
    from vllm import LLM as VllmLLM
    from vllm import SamplingParams as VllmSamplingParams

    # A configs/NAME folder has no tokenizer: token-id prompts, token-id outputs.
    no_tokenizer = holds_only_a_config(path)
    llm = VllmLLM(str(path), load_format=load_format, skip_tokenizer_init=no_tokenizer,
                  max_model_len=max_model_len, gpu_memory_utilization=0.6)
    params = [VllmSamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n,
                                 detokenize=not no_tokenizer)
              for n in max_tokens]
    inputs = [{"prompt_token_ids": p} for p in prompts]
    llm.generate(inputs[:2], params[:2], use_tqdm=False)  # warm-up
    start = time.perf_counter()
    llm.generate(inputs, params, use_tqdm=False)
    tps = sum(max_tokens) / (time.perf_counter() - start)
    print(f"vLLM:         {tps:,.0f} output tok/s ({len(prompts)} sequences)")
    return tps


def step_timeline(llm, prompts, params, device: str, path: Path) -> None:
    """Where the end-to-end time goes: every step of the workload, phase by phase.

    Host phases of one LLMEngine.step(): schedule (Scheduler.schedule), prepare (the
    runner's host -> device inputs), launch (the rest of ModelRunner.run: queueing the
    forward pass and the sampler), wait (SampledTokens.token_ids: the host idles until the
    device is done), postprocess. With async scheduling the wait is for the step queued by
    the call before.

    Beside each step's time, its roofline (benchmarks/roofline.py): the bytes it must read
    and write and the FLOPs it must do, and the least time they take at this machine's
    measured copy bandwidth and matmul throughput. With async scheduling a call plans and
    queues one step and returns the tokens of the step queued by the call before, and its
    time is mostly the wait for that earlier step: so each record carries the roofline of the
    step whose tokens it returns, the one its prefill flag and token count describe too.
    """
    import myvllm.engine.model_runner as runner_module
    from benchmarks.roofline import ModelShape, measure_ceilings, step_work, summarize
    from myvllm.worker.staging import SampledTokens
    from myvllm.engine.model_runner import samples_this_step

    runner, scheduler = llm.model_runner, llm.scheduler
    spent: dict[str, float] = {}
    shape = ModelShape.from_engine(llm)
    copy_gb_s, matmul_tflop_s = measure_ceilings(device)
    chunked = llm.config.enable_chunked_prefill
    scheduled: list[tuple[list[tuple[int, int]], int]] = []  # (rows, sampled rows) per step

    def recording_schedule(schedule):
        def wrapper():
            seqs, is_prefill = schedule()
            if chunked:
                rows = [(seq.num_new_tokens, seq.num_computed_tokens) for seq in seqs]
                sampled = sum(samples_this_step(seq) for seq in seqs)
            else:
                rows = [((len(seq) - seq.num_cached_tokens) if is_prefill else 1, len(seq))
                        for seq in seqs]
                sampled = len(seqs)
            scheduled.append((rows, sampled))
            return seqs, is_prefill
        return wrapper

    def timed(name: str, fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - start
        return wrapper

    originals = {(scheduler, "schedule"): scheduler.schedule}
    scheduler.schedule = recording_schedule(scheduler.schedule)
    for owner, name in ((scheduler, "schedule"), (scheduler, "postprocess"), (runner, "run"),
                        (runner.inputs, "prepare_prefill"), (runner.inputs, "prepare_decode"),
                        (runner_module, "prepare_sample"), (SampledTokens, "token_ids")):
        originals.setdefault((owner, name), getattr(owner, name))
        setattr(owner, name, timed(name, getattr(owner, name)))
    steps = []
    # With async scheduling: the roofline and context of the step the last call queued, which
    # the next call waits for and reports.
    queued_work: list = []
    queued_context: int | None = None
    try:
        # Key 2: the second throughput run used key 1; its blocks are still cached.
        for prompt, param in zip(fresh_copy(prompts, key=2), params):
            # Not streamed, as in generate(): nobody reads these tokens as they come.
            llm.add_request(prompt, param, streamed=False)
        if device == "cuda":
            torch.cuda.synchronize()
        run_start = time.perf_counter()
        output_tokens = 0
        while not llm.is_finished():
            spent.clear()
            scheduled.clear()
            running = list(scheduler.running)
            start = time.perf_counter()
            finished, num_tokens = llm.step()
            total = time.perf_counter() - start
            output_tokens += sum(len(out["token_ids"]) for out in finished)
            # The step this call planned; with async scheduling it was queued, and its tokens
            # (and this roofline) belong to the next call's record.
            work = [step_work(shape, rows, sampled) for rows, sampled in scheduled]
            context = sum(len(s) for s in running)
            if llm.async_scheduling:
                work, queued_work = queued_work, work
                context, queued_context = queued_context, context
            prepare = sum(spent.get(k, 0.0) for k in
                          ("prepare_prefill", "prepare_decode", "prepare_sample"))
            steps.append(dict(
                prefill=num_tokens > 0, tokens=abs(num_tokens),
                context=context if num_tokens < 0 else None,
                total_ms=total * 1e3, schedule_ms=spent.get("schedule", 0.0) * 1e3,
                prepare_ms=prepare * 1e3, launch_ms=(spent.get("run", 0.0) - prepare) * 1e3,
                wait_ms=spent.get("token_ids", 0.0) * 1e3,
                postprocess_ms=spent.get("postprocess", 0.0) * 1e3,
                ideal_ms=sum(w.ideal_ms(copy_gb_s, matmul_tflop_s) for w in work),
                bytes_read=sum(w.bytes_read for w in work), flops=sum(w.flops for w in work)))
        run_s = time.perf_counter() - run_start
    finally:
        for (owner, name), fn in originals.items():
            setattr(owner, name, fn)
    path.write_text(json.dumps(steps))
    print(f"timeline: {len(steps)} steps in {run_s:.2f} s (written to {path})")
    buckets = [("prefill", lambda s: s["prefill"])] + [
        (f"decode batch {lo}-{hi}",
         lambda s, lo=lo, hi=hi: not s["prefill"] and lo <= s["tokens"] <= hi)
        for lo, hi in ((241, 256), (129, 240), (33, 128), (9, 32), (1, 8))]
    keys = ("total_ms", "schedule_ms", "prepare_ms", "launch_ms", "wait_ms", "postprocess_ms")
    print(f"{'steps':>22} {'count':>6} {'total s':>8} " + " ".join(f"{k[:-3]:>11}" for k in keys)
          + "   (mean ms per step)")
    for name, select in buckets:
        chosen = [s for s in steps if select(s)]
        if not chosen:
            continue
        means = [sum(s[k] for s in chosen) / len(chosen) for k in keys]
        print(f"{name:>22} {len(chosen):>6} {sum(s['total_ms'] for s in chosen) / 1e3:>8.2f} "
              + " ".join(f"{m:>11.3f}" for m in means))
    print(summarize(steps, buckets, output_tokens, copy_gb_s, matmul_tflop_s))


def profile_decode(llm, prompts, params, steps: int, device: str) -> None:
    """Where a decode step's time goes: host work vs GPU kernels, at the full batch."""
    from torch.profiler import ProfilerActivity, profile

    for prompt, param in zip(prompts, params):
        llm.add_request(prompt, param)
    while llm.scheduler.waiting:  # prefill everything first (prefill-first scheduling)
        llm.step()
    batch = len(llm.scheduler.running)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    llm.step()  # one decode step outside the profile
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        llm.step()
    sync()
    plain = (time.perf_counter() - start) / steps
    print(f"decode steps at batch {len(llm.scheduler.running)}, no profiler: "
          f"{plain * 1e3:.2f} ms per step")
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(steps):
            llm.step()
    elapsed = (time.perf_counter() - start) / steps
    print(f"profile: {steps} decode steps at batch {batch}, {elapsed * 1e3:.2f} ms per step "
          "(with profiler overhead)")
    sort = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=sort, row_limit=40))
    while not llm.is_finished():  # finish the requests so the engine is clean again
        llm.step()


def plot(results: dict[str, object], path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib not installed: no plot (uv sync --extra bench)")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names, values = [], []
    for name, key in (("myvllm", "myvllm_tok_s"), ("myvllm, 2nd run", "myvllm_second_run_tok_s"),
                      ("HF transformers", "hf_tok_s"), ("vLLM", "vllm_tok_s")):
        if isinstance(results.get(key), float):
            names.append(name)
            values.append(results[key])
    fig, ax = plt.subplots(figsize=(6, 3))
    colors = {"myvllm": "tab:blue", "myvllm, 2nd run": "tab:cyan", "HF transformers": "tab:gray",
              "vLLM": "tab:orange"}
    ax.bar(names, values, color=[colors[n] for n in names])
    ax.set_ylabel("output tokens / s")
    ax.set_title(f"{results['model']} shapes, {results['device']}")
    for i, v in enumerate(values):
        ax.text(i, v, f"{v:,.0f}", ha="center", va="bottom")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
