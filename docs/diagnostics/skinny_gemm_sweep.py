"""Time cuBLAS (F.linear) against skinny_gemm at decode shapes, inside CUDA graphs (GPU only).

Run from the repository root: python3 docs/diagnostics/skinny_gemm_sweep.py
"""
import sys, itertools
sys.path.insert(0, "src")
import torch, torch.nn.functional as F
from myvllm.kernels.skinny_gemm_kernel import skinny_gemm_triton, skinny_gemm_config
torch.manual_seed(0)
SHAPES = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072), "lm_head": (151936, 1024)}
REPS = 40

def graph_time(fn):
    fn(); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(REPS): fn()
    g.replay(); torch.cuda.synchronize()
    s, e = torch.cuda.Event(True), torch.cuda.Event(True)
    s.record()
    for _ in range(5): g.replay()
    e.record(); torch.cuda.synchronize()
    return s.elapsed_time(e) / (5 * REPS) * 1e3  # us

sweep = [(bn, bk, nw) for bn in (2, 4, 8, 16) for bk in (128, 256, 512, 1024) for nw in (2, 4, 8)]
for m in (1, 2, 4, 8):
    print(f"--- M={m}", flush=True)
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 32
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ref = (x.float() @ w.float().t())
        cub = graph_time(lambda: F.linear(x, w))
        out = skinny_gemm_triton(x, w)
        err = (out.float() - ref).abs().max().item()
        ours = graph_time(lambda: skinny_gemm_triton(x, w))
        gb = n * k * 2 / 1e9
        line = f"{name:8s} M={m} cuBLAS {cub:7.2f} us ({gb/cub*1e6/1e3:5.2f} TB/s)  skinny {skinny_gemm_config(m,n,k)} {ours:7.2f} us ({gb/ours*1e6/1e3:5.2f} TB/s) err {err:.3g}"
        if m in (1, 8) and name != "lm_head":
            best = None
            for cfg in sweep:
                bn, bk, nw = cfg
                if triton_bm := 1 << (m - 1).bit_length():
                    if triton_bm * bn * bk > 32768: continue
                try:
                    t = graph_time(lambda: skinny_gemm_triton(x, w, cfg))
                except Exception as ex:
                    continue
                if best is None or t < best[0]: best = (t, cfg)
            line += f"  | best {best[1]} {best[0]:.2f} us ({gb/best[0]*1e6/1e3:5.2f} TB/s)"
        print(line, flush=True)
