"""Which Triton kernels are compiled during a timed throughput run, after the warm-up? (GPU only)

Run from the repository root: python3 docs/diagnostics/compile_diag.py
"""
import sys, time, tempfile
from pathlib import Path
sys.path.insert(0, "src"); sys.path.insert(0, ".")
import torch, triton
from benchmarks.workload import build_random_checkpoint, QWEN3_CONFIG, make_workload
from myvllm import LLM, SamplingParams

phase = ["init"]
log = []
def hook(*args, **kwargs):
    log.append((phase[0], time.perf_counter(), kwargs.get("repr", "?")[:400]))
    return None
triton.knobs.runtime.jit_post_compile_hook = hook
path = build_random_checkpoint(QWEN3_CONFIG, Path(tempfile.mkdtemp()), "cuda", False)
llm = LLM(str(path), gpu_memory_utilization=0.6, max_model_length=2048, max_num_sequences=256,
          max_num_batched_tokens=16384)
prompts, max_tokens = make_workload(256, 100, 1024, 1024, 10000)
params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in max_tokens]
phase[0] = "warmup"
llm.generate(prompts[:2], params[:2], use_tqdm=False)
for run in ("run1", "run2"):
    phase[0] = run
    ps = prompts if run == "run1" else [[t ^ 1 for t in p] for p in prompts]
    torch.cuda.synchronize(); t = time.perf_counter()
    llm.generate(ps, params, use_tqdm=False)
    torch.cuda.synchronize(); print(f"{run}: {time.perf_counter() - t:.2f} s", flush=True)
from collections import Counter
print(Counter(p for p, _, _ in log))
for p, t, r in log:
    if p in ("warmup", "run1", "run2"):
        print(p, r)
llm.exit()
