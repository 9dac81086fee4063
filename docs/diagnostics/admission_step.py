"""Why the step that admits a long prompt beside decoding streams is the longest (GPU only).

Run from the repository root: python3 docs/diagnostics/admission_step.py

The stall scenario of benchmarks/benchmark_latency.py with the engine's defaults (64
sequences decode, a 16,000-token prompt joins), twice on one engine with different prompts,
so that a cost paid once per engine shows apart from one paid at every admission. Each step's host phases are
timed with a device sync after each (schedule; the runner's run() until it returns, i.e.
host work and launches; the wait for the device; reading back and postprocessing), for the
last decode step before the join and the first four after it. The second admission step is
then run again under cProfile (the host's Python functions by their own time). The first
admission on the engine also runs under torch.profiler: its CUDA API calls and operators by
their own host time, where a kernel loaded on its first launch shows as a long launch call.
"""
import cProfile
import pstats
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "src"))
import torch  # noqa: E402

from benchmarks.workload import QWEN3_CONFIG, build_random_checkpoint  # noqa: E402
from mixed_step_profile import VOCAB, start_decoders, stop  # noqa: E402  (same folder)
from myvllm import LLM, SamplingParams  # noqa: E402

PHASES: dict[str, float] = {}


def timed(name: str, fn, split_device_wait: bool = False):
    def wrapper(*args, **kwargs):
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        host = time.perf_counter()
        torch.cuda.synchronize()
        end = time.perf_counter()
        if split_device_wait:
            PHASES[name] = PHASES.get(name, 0.0) + (host - start) * 1e3
            PHASES["device"] = PHASES.get("device", 0.0) + (end - host) * 1e3
        else:
            PHASES[name] = PHASES.get(name, 0.0) + (end - start) * 1e3
        return out
    return wrapper


def one_step(llm: LLM, label: str, profiler: cProfile.Profile | None = None,
             torch_profile: bool = False) -> list:
    PHASES.clear()
    torch.cuda.synchronize()
    start = time.perf_counter()
    if profiler:
        profiler.enable()
    if torch_profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            outputs, _ = llm.step_outputs()
            torch.cuda.synchronize()
    else:
        outputs, _ = llm.step_outputs()
    if profiler:
        profiler.disable()
    torch.cuda.synchronize()
    total = (time.perf_counter() - start) * 1e3
    phases = ", ".join(f"{k} {v:.2f}" for k, v in PHASES.items())
    print(f"  {label:28s} {total:6.2f} ms: {phases}", flush=True)
    if torch_profile:
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20),
              flush=True)
    return outputs


def scenario(llm: LLM, trial: int, profile: bool) -> None:
    ids = start_decoders(llm, salt=trial)  # 64 sequences decoding
    for _ in range(5):
        llm.step()
    print(f"trial {trial}:", flush=True)
    one_step(llm, "decode step before the join")
    long_id = llm.add_request([(3 * j + 1 + 101 * trial) % VOCAB for j in range(16_000)],
                              SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    for i in range(4):
        one_step(llm, f"step {i} after the join", torch_profile=trial == 0 and i == 0)
    if profile:  # the admission again, under cProfile: abort it and add another prompt
        llm.abort(long_id)
        for _ in range(3):
            llm.step()
        llm.add_request([(5 * j + 2) % VOCAB for j in range(16_000)],
                        SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        profiler = cProfile.Profile()
        one_step(llm, "admission under cProfile", profiler)
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    stop(llm, ids + [long_id])


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = build_random_checkpoint(QWEN3_CONFIG, Path(tmp), "cuda", False)
        llm = LLM(str(path))
        sched, runner = llm.scheduler, llm.model_runner
        sched.schedule = timed("schedule", sched.schedule)
        runner.run = timed("run (host)", runner.run, split_device_wait=True)
        llm.engine_core._read_back = timed("read back", llm.engine_core._read_back)
        for trial in range(3):
            scenario(llm, trial, profile=trial == 2)
        llm.exit()


if __name__ == "__main__":
    main()
