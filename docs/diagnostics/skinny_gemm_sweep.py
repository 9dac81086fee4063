"""Time cuBLAS (F.linear) against skinny_gemm at decode shapes, inside CUDA graphs (GPU only).

Run from the repository root: python3 docs/diagnostics/skinny_gemm_sweep.py [MODEL ...]
(MODEL: 0.6b, 8b, 8b-tp2, 30b-a3b; default all). Each layer runs as the model runs it: the
qkv and gate_up matmuls with the RMSNorm prologue (and a residual), down with silu_and_mul,
o_proj plain. Several copies of each weight are cycled so that the timed calls read them
from memory, not from the 50 MB L2 (the first version of this script, whose output is
docs/raw/2026-11-30-h200-skinny-gemm-sweep.log, reused one copy: its 0.6B figures are partly
L2 reads). For every (model, layer, rows): cuBLAS, the current skinny_gemm_config, and the
fastest tiles of the sweep.
"""
import math
import sys

sys.path.insert(0, "src")
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from myvllm.kernels.skinny_gemm_kernel import (  # noqa: E402
    rms_norm_skinny_gemm_triton,
    silu_and_mul_skinny_gemm_triton,
    skinny_gemm_config,
    skinny_gemm_triton,
)

# layer -> (out N, in K, prologue)
MODELS = {
    "0.6b": {"qkv": (4096, 1024, "rms"), "o": (1024, 2048, "none"),
             "gate_up": (6144, 1024, "rms"), "down": (1024, 3072, "silu")},
    "8b": {"qkv": (6144, 4096, "rms"), "o": (4096, 4096, "none"),
           "gate_up": (24576, 4096, "rms"), "down": (4096, 12288, "silu")},
    "8b-tp2": {"qkv": (3072, 4096, "rms"), "o": (4096, 2048, "none"),
               "gate_up": (12288, 4096, "rms"), "down": (4096, 6144, "silu")},
    "30b-a3b": {"qkv": (5120, 2048, "rms"), "o": (2048, 4096, "none")},
}
REPS = 48
COPY_BYTES = 512 * 2**20  # weights cycled per timing: 10x the L2

# Every tile is a compile of its own: the full grid at one row, a small one at 2 and 4 rows
# (where the skinny kernel is used only for o_proj and down_proj).
SWEEP = {1: [(bn, bk, nw) for bn in (2, 4, 8, 16) for bk in (256, 512, 1024) for nw in (2, 4, 8)],
         2: [(bn, bk, nw) for bn in (4, 8) for bk in (256, 512) for nw in (2, 4)]}
SWEEP[4] = SWEEP[2]


def graph_time(fns) -> float:
    """us per call of fns (cycled), replayed from one CUDA graph."""
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(REPS):
            fns[i % len(fns)]()
    g.replay()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(True), torch.cuda.Event(True)
    s.record()
    for _ in range(5):
        g.replay()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / (5 * REPS) * 1e3


def calls(m: int, n: int, k: int, prologue: str, config=None):
    """(cuBLAS calls, skinny calls) over enough weight copies to miss the L2."""
    copies = max(1, math.ceil(COPY_BYTES / (n * k * 2)))
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 32 for _ in range(copies)]
    x = torch.randn(m, 2 * k if prologue == "silu" else k, device="cuda", dtype=torch.bfloat16)
    norm_w = torch.rand(k, device="cuda", dtype=torch.bfloat16) + 0.5
    res = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    if prologue == "rms":
        ours = [lambda w=w: rms_norm_skinny_gemm_triton(x, norm_w, 1e-6, w, res, config)
                for w in ws]
    elif prologue == "silu":
        ours = [lambda w=w: silu_and_mul_skinny_gemm_triton(x, w, config) for w in ws]
    else:
        ours = [lambda w=w: skinny_gemm_triton(x, w, config) for w in ws]
    xin = x[:, :k] if prologue == "silu" else x
    return [lambda w=w: F.linear(xin, w) for w in ws], ours


def main() -> None:
    models = sys.argv[1:] or list(MODELS)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}", flush=True)
    for model in models:
        for m in (1, 2, 4):
            for name, (n, k, prologue) in MODELS[model].items():
                if m > 1 and n > k:  # cuBLAS there (kernels.prefers_skinny_gemm)
                    continue
                gb = n * k * 2 / 1e9
                cublas, ours = calls(m, n, k, prologue)
                t_cub = graph_time(cublas)
                t_cur = graph_time(ours)
                results = []
                bm = 1 << (m - 1).bit_length()
                for cfg in SWEEP[m]:
                    bn, bk, nw = cfg
                    if bk > k or bm * bn * bk > 16384 or bm * bn * bk < 32 * nw:
                        continue
                    try:
                        _, fns = calls(m, n, k, prologue, cfg)
                        results.append((graph_time(fns), cfg))
                    except Exception as exc:  # a tile the compiler refuses: skip it
                        print(f"  {cfg}: {type(exc).__name__}", flush=True)
                    torch.cuda.empty_cache()
                results.sort()
                top = "  ".join(f"{c} {t:.1f}" for t, c in results[:4])
                print(f"{model:8s} {name:8s} M={m} N={n} K={k} floor {gb / 4.3e3 * 1e6:6.1f} us | "
                      f"cuBLAS {t_cub:6.1f} | current {skinny_gemm_config(m, n, k)} {t_cur:6.1f}"
                      f" | best {top}", flush=True)
                del cublas, ours
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
