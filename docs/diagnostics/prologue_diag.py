"""Per-call time inside a CUDA graph: separate op + skinny_gemm vs the fused prologues (GPU only).

Run from the repository root: python3 docs/diagnostics/prologue_diag.py
The log docs/raw/2026-11-30b-h200-prologue-diag.log also has "one-pass" lines, from a variant
this script does not carry: it scaled the sum by rstd at the end instead of normalising x
first (one pass over x, not two, but not the reference's rounding). It was no faster, which
is why the prologue reads x twice and rounds as the reference does.
"""
import sys
sys.path.insert(0, "src")
import torch
import myvllm.kernels.skinny_gemm_kernel as sk
from myvllm.kernels.layer_ops_triton import rms_norm_triton, silu_and_mul_triton
from myvllm.kernels.fused_reference import skinny_gemm_ref
from myvllm.kernels.reference import rms_norm_ref
torch.manual_seed(0)
REPS = 56

def graph_time(fn):
    fn(); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(REPS): fn()
    g.replay(); torch.cuda.synchronize()
    s, e = torch.cuda.Event(True), torch.cuda.Event(True)
    s.record()
    for _ in range(10): g.replay()
    e.record(); torch.cuda.synchronize()
    return s.elapsed_time(e) / (10 * REPS) * 1e3

bf = dict(device="cuda", dtype=torch.bfloat16)
for name, (n, k) in {"qkv": (4096, 1024), "gate_up": (6144, 1024)}.items():
    w = torch.randn(n, k, **bf) / 32
    x = torch.randn(1, k, **bf); r = torch.randn(1, k, **bf); nw = torch.rand(k, **bf) + 0.5
    ref_out, ref_res = rms_norm_ref(x, nw, 1e-6, r)
    ref = skinny_gemm_ref(ref_out, w).float()
    plain = graph_time(lambda: sk.skinny_gemm_triton(x, w))
    two_launch = graph_time(lambda: sk.skinny_gemm_triton(rms_norm_triton(x, nw, 1e-6, r)[0], w))
    line = f"{name:8s} plain {plain:.2f} us | norm + gemm {two_launch:.2f} us"
    for cfg in (None, (4, 512, 2), (8, 256, 2), (8, 1024, 4), (16, 512, 4), (16, 256, 4), (4, 1024, 4)):
        out, res = sk.rms_norm_skinny_gemm_triton(x, nw, 1e-6, w, r, cfg)
        err = (out.float() - ref).abs().max().item() / ref.abs().max().item()
        assert torch.equal(res, ref_res)
        t = graph_time(lambda: sk.rms_norm_skinny_gemm_triton(x, nw, 1e-6, w, r, cfg))
        line += f"\n   two-pass {cfg} {t:.2f} us rel.err {err:.2e}"
    print(line, flush=True)
n, k = 1024, 3072
w = torch.randn(n, k, **bf) / 32
gu = torch.randn(1, 2 * k, **bf)
plain = graph_time(lambda: sk.skinny_gemm_triton(silu_and_mul_triton(gu), w))
line = f"down     silu + gemm {plain:.2f} us, gemm alone {graph_time(lambda: sk.skinny_gemm_triton(gu[:, :k], w)):.2f}"
for cfg in (None, (4, 512, 4), (4, 1024, 8), (8, 512, 4), (2, 1024, 4)):
    t = graph_time(lambda: sk.silu_and_mul_skinny_gemm_triton(gu, w, cfg))
    line += f"\n   fused {cfg} {t:.2f} us"
print(line, flush=True)
