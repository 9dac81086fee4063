"""Decode at batch 1 and 256: host time per phase, with a sync between phases (GPU only).

Run from the repository root: python3 docs/diagnostics/host_phases.py

Written for the ModelRunner before async scheduling (commit faa5124's parent), whose output
docs/benchmarks.md cites. It reads internals that have changed since (graph_vars, the
separate LM head and sampler after a replay): to re-run it, check out that code.
"""
import sys, time, tempfile, random
from pathlib import Path
sys.path.insert(0, "src"); sys.path.insert(0, ".")
import torch
from benchmarks.workload import build_random_checkpoint, QWEN3_CONFIG
from myvllm import LLM, SamplingParams
from myvllm.utils.context import forward_context

tmp = tempfile.mkdtemp()
path = build_random_checkpoint(QWEN3_CONFIG, Path(tmp), "cuda", False)
llm = LLM(str(path), gpu_memory_utilization=0.6, max_model_length=2048, max_num_sequences=256,
          async_scheduling=False,  # the phases are timed one after another
          max_num_batched_tokens=16384)
runner, sched = llm.model_runner, llm.scheduler
rng = random.Random(1)
for bs in (1, 256):
    for i in range(bs):
        llm.add_request([rng.randint(0, 9999) for _ in range(128)],
                        SamplingParams(temperature=0.0 if bs == 1 else 0.6, max_tokens=300, ignore_eos=True))
    while sched.waiting:
        llm.step()
    for _ in range(5):
        llm.step()
    names = ["schedule", "prepare_decode", "prepare_sample", "graph_copies", "replay_launch", "gpu_drain", "logits_sample", "tolist", "postprocess"]
    acc = dict.fromkeys(names, 0.0)
    N = 50
    sync = torch.cuda.synchronize
    for _ in range(N):
        sync()
        t = [time.perf_counter()]
        seqs, is_prefill = sched.schedule(); t.append(time.perf_counter())
        step = runner.prepare_decode(seqs); t.append(time.perf_counter())
        sa = runner.prepare_sample(seqs); sync(); t.append(time.perf_counter())
        with torch.inference_mode(), forward_context(**step.context):
            padded = step.input_ids.size(0)
            gv = runner.graph_vars; c = step.context
            gv["input_ids"][:padded] = step.input_ids; gv["positions"][:padded] = step.positions
            gv["slot_mapping"][:padded] = c["slot_mapping"]; gv["context_lens"][:padded] = c["context_lens"]
            gv["block_tables"][:padded] = c["block_tables"]; t.append(time.perf_counter())
            runner.graphs[padded].replay(); t.append(time.perf_counter())
            sync(); t.append(time.perf_counter())
            logits = runner.model.compute_logits(gv["outputs"][:len(seqs)])
            tok = runner.sampler(logits, **sa); t.append(time.perf_counter())
            ids = tok.tolist(); t.append(time.perf_counter())
        sched.postprocess(seqs, ids); t.append(time.perf_counter())
        for k, a, b in zip(names, t, t[1:]):
            acc[k] += b - a
    print(f"batch {bs}: " + ", ".join(f"{k} {v / N * 1e3:.3f}" for k, v in acc.items()) + " (ms, synced phases)", flush=True)
    # GPU time of the graph alone, back to back
    padded = runner.decode_batch_size(len(sched.running))
    g = runner.graphs[padded]
    sync(); s = time.perf_counter()
    for _ in range(100): g.replay()
    sync(); print(f"batch {bs}: graph replay back-to-back {(time.perf_counter()-s)*10:.3f} ms each", flush=True)
    s = time.perf_counter()
    for _ in range(100): g.replay()
    e = time.perf_counter(); sync(); print(f"batch {bs}: replay() CPU launch {(e-s)*10:.3f} ms each", flush=True)
    # unsynced full steps
    sync(); s = time.perf_counter()
    for _ in range(50): llm.step()
    sync(); print(f"batch {bs}: llm.step() {(time.perf_counter()-s)*20:.3f} ms each", flush=True)
    while not llm.is_finished(): llm.step()
s = time.perf_counter()
for _ in range(1000): torch.tensor([1, 2, 3], dtype=torch.int64, pin_memory=True)
print(f"pinned torch.tensor of 3 ints: {(time.perf_counter()-s):.3f} ms each")
x = torch.tensor([1, 2, 3], dtype=torch.int64, pin_memory=True)
s = time.perf_counter()
for _ in range(1000): x.to("cuda", non_blocking=True)
print(f".to(cuda, non_blocking) of a pinned 3-int tensor: {(time.perf_counter()-s):.3f} ms each")
llm.exit()
