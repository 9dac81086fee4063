"""The decode attention kernel's two programs compiled for an H100/H200 (sm_90) without a GPU:
registers, spills, shared memory and the instructions of the key loop, per tile.

Run from the repository root: python3 docs/diagnostics/decode_sass_count.py [--cache fp8|bf16]
[--group G]

Triton compiles to PTX and the bundled ptxas to a cubin on any machine; nothing is launched.
Integer arguments get the divisibility Triton's launcher would give them (strides and
pointers by 16), without which the loads are not vectorised and the counts mean nothing. The
loop is the key loop (the backward branch of the SASS); "a key per warp" is its instructions
times the warps over the keys an iteration reads, the work one key costs the SM's issue
slots (an H200 issues ~1.0e12 warp-instructions a second: 132 SMs x 4 x 1.98 GHz).

What it showed (triton 3.9, 2026-12-06), fp8 cache, 2 query heads a kv head: the dot program
issues fewer instructions a key (31 at 64/2/4, 44 at 64/4/3) than the CUDA-core one (56-65),
so issue slots do not explain its 151 us at a full batch (~40 us of issue); its loop reads
the fp8 tiles from shared memory with 172 LDS and 136 F2FP per 64 keys (a bf16 cache's dot
loop: 15 LDS and 28 LDSM, ldmatrix), the converted tile's dot-operand layout being built
element by element. The CUDA-core loop reads its tile with 15 LDS per 32 keys, no layout
conversion, at 96 registers (32/4/3/2). Over a bf16 cache the CUDA-core loop takes 77
instructions a key (bf16 -> float32 by shifts) against the dot's 27.
"""
import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, "src")
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # as compiled at run time, quietly
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from myvllm.kernels import decode_attention  # noqa: E402

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
POINTERS = ("q_ptr", "k_cache_ptr", "v_cache_ptr", "block_tables_ptr", "context_lens_ptr",
            "o_ptr", "m_part_ptr", "l_part_ptr", "acc_part_ptr")
TILES = {"dot": [(64, 2, 4, 1), (64, 4, 3, 1)],
         "cuda_cores": [(16, 4, 3, 1), (32, 8, 3, 1), (32, 4, 3, 2), (64, 4, 3, 2), (64, 8, 3, 2)]}


def compile_kernel(program: str, cache: str, group: int, tile: tuple[int, int, int, int]):
    block_n, warps, stages, keys_per_row = tile
    kernel = (decode_attention.paged_decode_cuda_cores_kernel if program == "cuda_cores"
              else decode_attention._paged_decode_split_kernel)
    types = {"k_cache_ptr": cache, "v_cache_ptr": cache, "block_tables_ptr": "i32",
             "context_lens_ptr": "i32", "m_part_ptr": "fp32", "l_part_ptr": "fp32",
             "acc_part_ptr": "fp32"}
    signature = {}
    for name in kernel.arg_names:
        if name in POINTERS:
            signature[name] = "*" + types.get(name, "bf16")
        elif name.endswith("_scale"):
            signature[name] = "fp32"
        elif name.startswith("stride"):
            signature[name] = "i32"
        else:
            signature[name] = "constexpr"
    constants = dict(GROUP=group, HEAD_DIM=128, BLOCK_D=128, BLOCK_N=block_n, PAGE=16,
                     NUM_SPLITS=1, USE_PDL=False)
    if program == "cuda_cores":
        constants.update(LOAD_STAGES=stages, KEYS_PER_ROW=keys_per_row)
    else:
        constants.update(G_PAD=max(16, triton.next_power_of_2(group)), DOT_PRECISION="tf32")
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names)
             if name in POINTERS or name.startswith("stride")}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps, "num_stages": stages})


def loop_counts(cubin: bytes) -> tuple[str, collections.Counter]:
    """(cuobjdump's resource line, the opcodes of the last loop's body)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([os.path.join(BIN, "cuobjdump"), "-res-usage", f.name],
                               capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", f.name],
                              capture_output=True, text=True, check=True).stdout
    found = re.search(r"REG:\d+ STACK:\d+", usage)
    code = [(int(a, 16), t) for a, t in re.findall(r"/\*([0-9a-f]{4,})\*/\s*(.*?);", sass)]
    body: list[str] = []
    for address, text in code:
        branch = re.search(r"BRA.*?0x([0-9a-f]+)", text)
        if branch and int(branch.group(1), 16) < address:
            start = int(branch.group(1), 16)
            body = [t for a, t in code if start <= a <= address]
    opcodes = collections.Counter((t.split()[1] if t.startswith("@") else t.split()[0])
                                  .split(".")[0] for t in body)
    return found.group(0) if found else usage.strip(), opcodes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cache", choices=("fp8", "bf16"), default="fp8")
    p.add_argument("--group", type=int, default=2, help="query heads a kv head (default 2)")
    args = p.parse_args()
    cache = "fp8e4nv" if args.cache == "fp8" else "bf16"
    print(f"# sm_90, bf16 queries, {args.cache} cache, group {args.group}, head_dim 128, "
          f"16-token blocks | triton {triton.__version__}")
    for program, tiles in TILES.items():
        for tile in tiles:
            compiled = compile_kernel(program, cache, args.group, tile)
            usage, ops = loop_counts(compiled.asm["cubin"])
            n = sum(ops.values())
            top = ", ".join(f"{op} {c}" for op, c in ops.most_common(8))
            print(f"{program:<10} {'/'.join(map(str, tile)):<10} {usage} smem "
                  f"{compiled.metadata.shared:>6} | loop {n:>4} instructions, "
                  f"{n * tile[1] / tile[0]:5.1f} a key per warp | {top}", flush=True)


if __name__ == "__main__":
    main()
