"""How many torch threads the CPU path should use: generate() timed with 1 and 2 threads.

    uv run python benchmarks/benchmark_cpu_threads.py            # quiet machine
    uv run python benchmarks/benchmark_cpu_threads.py --load 2   # 2 busy processes beside it

Each (model, threads) run is a fresh process with Config.cpu_threads set, generating 4 prompts x 64 greedy tokens after one warm-up call; the figure is the
generate() time, the median of --repeats runs. Models: the bundled SmolLM2-135M (hidden 576,
30 layers) and a tiny random Llama like the tests' (hidden 64, 2 layers, from config.json
alone). --load N starts N processes that spin on a core each for the whole measurement, as
other jobs (or other test processes) do on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TINY_LLAMA = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=64,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, vocab_size=256, intermediate_size=128,
                  max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=1,
                  eos_token_id=0, torch_dtype="float32", tie_word_embeddings=False)

ONE_RUN = """
import sys, time
from myvllm import LLM, SamplingParams
model = sys.argv[2] or None
kw = dict(load_format="dummy") if model and not model.endswith(".gguf") else {}
llm = LLM(model, device="cpu", cpu_threads=int(sys.argv[1]), num_kvcache_blocks=256,
          max_model_length=512, **kw)
params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
prompts = [[1 + (7 * i + j) % 200 for j in range(24 + 8 * i)] for i in range(4)]
llm.generate(prompts, params, use_tqdm=False)  # warm-up
times = []
for _ in range(int(sys.argv[3])):
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    times.append(time.perf_counter() - start)
print("TIMES", *times)
"""


def run_one(threads: int, model: str, repeats: int) -> list[float]:
    out = subprocess.run([sys.executable, "-c", ONE_RUN, str(threads), model, str(repeats)],
                         capture_output=True, text=True, check=True)
    line = next(x for x in out.stdout.splitlines() if x.startswith("TIMES"))
    return [float(t) for t in line.split()[1:]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--load", type=int, default=0, help="busy processes beside the runs")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--models", default="tiny,bundled")
    parser.add_argument("--bundled-path", default="",
                        help="the bundled model's .gguf file (default: the installed package's)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(TINY_LLAMA))
        paths = {"tiny": tmp, "bundled": args.bundled_path}
        burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                   for _ in range(args.load)]
        try:
            time.sleep(0.5 if burners else 0)
            for name in args.models.split(","):
                for threads in (1, 2):
                    times = run_one(threads, paths[name], args.repeats)
                    print(f"{name:8s} threads={threads} load={args.load}  generate "
                          f"median {statistics.median(times):6.2f} s  (runs: "
                          f"{', '.join(f'{t:.2f}' for t in times)})", flush=True)
        finally:
            for burner in burners:
                burner.kill()


if __name__ == "__main__":
    main()
