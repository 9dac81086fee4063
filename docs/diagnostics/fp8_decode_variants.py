"""Variants of the fp8 cache's decode attention, against the shipped kernel (GPU; CPU check).

Run from the repository root: python3 docs/diagnostics/fp8_decode_variants.py
(TRITON_INTERPRET=1 ... --check on a CPU runs the correctness check of the fp16 variants only.)

decode_tile_sweep.py showed the shipped kernel over an fp8 cache at ~50% of the copy
bandwidth where the bf16 cache's runs at 90-96%: it is not bound by the bytes it reads. Each
variant here is one idea about what binds it instead, timed at full-batch shapes (one split):

  shipped     paged_attention_decode_triton, the best tile of the sweep
  transposed  scores as K @ q^T ([keys, heads]) and acc^T = V^T @ p: the converted tile is
              the dot's first operand (the one a Hopper tensor core takes from registers),
              the padded query heads its narrow side
  fp8-dots    the dots in fp8 (e4m3) on the tensor cores: q quantized per program with its
              own scale, the probabilities as p * 448, no conversion of the cache's tiles
  fp8-dots-T  both ideas
  no-dot      no tensor cores: the scores and the weighted sum of V as broadcast products
              summed on the CUDA cores, over the GROUP real query heads only (no padding to
              the 16 rows a tensor-core dot needs: with 2 query heads a kv head, 7/8 of the
              padded softmax is wasted work)

Each variant's output is checked against the float32 reference (kernels/reference.py) first;
its error is printed beside its time.
"""
import itertools
import sys

sys.path.insert(0, "src")
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from myvllm.kernels.decode_attention import DecodeConfig, paged_attention_decode_triton  # noqa: E402
from myvllm.kernels.reference import paged_attention_decode_ref  # noqa: E402

LOG2E = 1.4426950408889634
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 16, 8, 128, 16


@triton.jit
def _variant_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, o_ptr, qk_scale, k_scale, v_scale,
                    stride_qb, stride_qh, stride_cb, stride_cs, stride_ch, stride_bt,
                    stride_ob, stride_oh,
                    GROUP: tl.constexpr, G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                    BLOCK_N: tl.constexpr, PAGE: tl.constexpr, FP8_DOTS: tl.constexpr,
                    TRANSPOSED: tl.constexpr, COMPUTE: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    context_len = tl.load(lens_ptr + seq)
    offs_g = tl.arange(0, G_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    g_mask = offs_g < GROUP
    heads = kv_head * GROUP + offs_g
    q = tl.load(q_ptr + seq.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None], other=0.0).to(tl.float32)
    if FP8_DOTS:
        q_scale = tl.maximum(tl.max(tl.max(tl.abs(q), 1), 0) / 448.0, 1e-12)
        q = (q / q_scale).to(tl.float8e4nv)
        score_scale = qk_scale * k_scale * q_scale
    else:
        q = q.to(COMPUTE)
        score_scale = qk_scale * k_scale
    m_i = tl.full([G_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([G_PAD], dtype=tl.float32)
    if TRANSPOSED:
        acc = tl.zeros([HEAD_DIM, G_PAD], dtype=tl.float32)
    else:
        acc = tl.zeros([G_PAD, HEAD_DIM], dtype=tl.float32)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    for start in range(0, context_len, BLOCK_N):
        pos = start + offs_n
        n_mask = pos < context_len
        blk = tl.load(bt_row + pos // PAGE, mask=n_mask, other=0).to(tl.int64)
        rows = kv_head * stride_ch + blk * stride_cb + (pos % PAGE) * stride_cs
        k = tl.load(k_ptr + rows[:, None] + offs_d[None, :], mask=n_mask[:, None], other=0.0)
        if not FP8_DOTS:
            k = k.to(COMPUTE)
        if TRANSPOSED:
            s = tl.dot(k, tl.trans(q)) * score_scale  # [BLOCK_N, G_PAD]
            s = tl.where(n_mask[:, None], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 0))
            alpha = tl.math.exp2(m_i - m_new)
            p = tl.math.exp2(s - m_new[None, :])
            l_i = l_i * alpha + tl.sum(p, 0)
        else:
            s = tl.dot(q, tl.trans(k)) * score_scale  # [G_PAD, BLOCK_N]
            s = tl.where(n_mask[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.math.exp2(m_i - m_new)
            p = tl.math.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + rows[:, None] + offs_d[None, :], mask=n_mask[:, None], other=0.0)
        if FP8_DOTS:
            p = (p * 448.0).to(tl.float8e4nv)
        else:
            v = v.to(COMPUTE)
            p = p.to(COMPUTE)
        if TRANSPOSED:
            acc = acc * alpha[None, :]
            acc = tl.dot(tl.trans(v), p, acc)  # [HEAD_DIM, G_PAD]
        else:
            acc = acc * alpha[:, None]
            acc = tl.dot(p, v, acc)
        m_i = m_new
    factor = v_scale
    if FP8_DOTS:
        factor = v_scale / 448.0
    if TRANSPOSED:
        out = tl.trans(acc) * factor
    else:
        out = acc * factor
    out = out / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(o_ptr + seq.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=g_mask[:, None])


@triton.jit
def _no_dot_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, o_ptr, qk_scale, k_scale, v_scale,
                   stride_qb, stride_qh, stride_cb, stride_cs, stride_ch, stride_bt,
                   stride_ob, stride_oh,
                   GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                   PAGE: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    context_len = tl.load(lens_ptr + seq)
    offs_g = tl.arange(0, GROUP)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    heads = kv_head * GROUP + offs_g
    q = tl.load(q_ptr + seq.to(tl.int64) * stride_qb + heads[:, None] * stride_qh
                + offs_d[None, :]).to(tl.float32) * (qk_scale * k_scale)
    m_i = tl.full([GROUP], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP], dtype=tl.float32)
    acc = tl.zeros([GROUP, HEAD_DIM], dtype=tl.float32)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    for start in range(0, context_len, BLOCK_N):
        pos = start + offs_n
        n_mask = pos < context_len
        blk = tl.load(bt_row + pos // PAGE, mask=n_mask, other=0).to(tl.int64)
        rows = kv_head * stride_ch + blk * stride_cb + (pos % PAGE) * stride_cs
        k = tl.load(k_ptr + rows[:, None] + offs_d[None, :], mask=n_mask[:, None], other=0.0)
        s = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], 2)  # [GROUP, BLOCK_N]
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + rows[:, None] + offs_d[None, :], mask=n_mask[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], 1)
        m_i = m_new
    out = acc * v_scale / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(o_ptr + seq.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
             out.to(o_ptr.dtype.element_ty))


def run_no_dot(q, k_cache, v_cache, tables, lens, k_scale, v_scale, *, block_n, num_warps,
               num_stages):
    o = torch.empty_like(q)
    _no_dot_kernel[(q.shape[0], KV_HEADS)](
        q, k_cache, v_cache, tables, lens, o, HEAD_DIM ** -0.5 * LOG2E, k_scale, v_scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        tables.stride(0), o.stride(0), o.stride(1),
        GROUP=HEADS // KV_HEADS, HEAD_DIM=HEAD_DIM, BLOCK_N=block_n, PAGE=k_cache.shape[1],
        num_warps=num_warps, num_stages=num_stages)
    return o


def run_variant(q, k_cache, v_cache, tables, lens, k_scale, v_scale, *, fp8_dots, transposed,
                block_n, num_warps, num_stages):
    batch = q.shape[0]
    o = torch.empty_like(q)
    group = HEADS // KV_HEADS
    compute = tl.float16 if (k_cache.dtype == torch.float8_e4m3fn or q.dtype == torch.float16) \
        else (tl.float32 if q.dtype == torch.float32 else tl.bfloat16)
    _variant_kernel[(batch, KV_HEADS)](
        q, k_cache, v_cache, tables, lens, o, HEAD_DIM ** -0.5 * LOG2E, k_scale, v_scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        tables.stride(0), o.stride(0), o.stride(1),
        GROUP=group, G_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=HEAD_DIM,
        BLOCK_N=block_n, PAGE=k_cache.shape[1], FP8_DOTS=fp8_dots, TRANSPOSED=transposed,
        COMPUTE=compute, num_warps=num_warps, num_stages=num_stages)
    return o


def make_case(batch, context, cache_dtype, q_dtype, device, k_scale=0.02, v_scale=0.02):
    blocks_per_seq = context // BLOCK
    num_blocks = batch * blocks_per_seq
    gen = torch.Generator(device=device).manual_seed(0)
    k = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, device=device, generator=gen)
    v = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, device=device, generator=gen)
    if cache_dtype == torch.float8_e4m3fn:  # values as the store kernel leaves them: x / scale
        k_cache, v_cache = (k / k_scale * 0.02).to(cache_dtype), (v / v_scale * 0.02).to(cache_dtype)
    else:
        k_cache, v_cache, k_scale, v_scale = k.to(cache_dtype), v.to(cache_dtype), 1.0, 1.0
    tables = torch.randperm(num_blocks, device=device, generator=gen).view(batch, blocks_per_seq)
    lens = torch.randint(context // 2, context + 1, (batch,), device=device, generator=gen)
    q = torch.randn(batch, HEADS, HEAD_DIM, device=device, generator=gen).to(q_dtype)
    return q, k_cache, v_cache, tables.to(torch.int32), lens.to(torch.int32), k_scale, v_scale


VARIANTS = {"fp8-dots": (True, False), "no-dot": None}


def check_on_cpu() -> None:
    q, kc, vc, bt, lens, ks, vs = make_case(3, 64, torch.float16, torch.float16, "cpu")
    ref = paged_attention_decode_ref(q.float(), kc, vc, bt, lens, HEAD_DIM ** -0.5, ks, vs)
    out = run_variant(q, kc, vc, bt, lens, ks, vs, fp8_dots=False, transposed=True,
                      block_n=16, num_warps=4, num_stages=1)
    print("transposed, fp16, interpreted: max error", (out.float() - ref).abs().max().item())
    out = run_no_dot(q, kc, vc, bt, lens, ks, vs, block_n=16, num_warps=4, num_stages=1)
    print("no-dot, fp16, interpreted: max error", (out.float() - ref).abs().max().item())


def main() -> None:
    if "--check" in sys.argv:
        check_on_cpu()
        return
    for batch, context in ((256, 1024), (256, 512), (64, 2048)):
        q, kc, vc, bt, lens, ks, vs = make_case(batch, context, torch.float8_e4m3fn,
                                                torch.bfloat16, "cuda")
        ref = paged_attention_decode_ref(q.float(), kc, vc, bt, lens, HEAD_DIM ** -0.5, ks, vs)
        read = 2 * int(lens.sum()) * KV_HEADS * HEAD_DIM  # fp8: one byte an element
        ms = triton.testing.do_bench(lambda: paged_attention_decode_triton(
            q, kc, vc, bt, lens, HEAD_DIM ** -0.5, config=DecodeConfig(64, 2, 4),
            k_scale=ks, v_scale=vs), warmup=10, rep=60)
        out = paged_attention_decode_triton(q, kc, vc, bt, lens, HEAD_DIM ** -0.5,
                                            config=DecodeConfig(64, 2, 4), k_scale=ks, v_scale=vs)
        print(f"batch {batch} ctx <= {context}: shipped 64/2/4 {1e3 * ms:7.1f} us "
              f"{read / ms / 1e9:5.2f} TB/s, max error {(out.float() - ref).abs().max().item():.2e}",
              flush=True)
        for name, flags in VARIANTS.items():
            results = []
            tiles = ((16, 32, 64), (2, 4, 8), (2, 3)) if flags is None else ((64, 128), (4,), (3, 4))
            for block_n, warps, stages in itertools.product(*tiles):
                kw = dict(block_n=block_n, num_warps=warps, num_stages=stages)
                if flags is None:
                    fn = run_no_dot
                else:
                    fn = run_variant
                    kw.update(fp8_dots=flags[0], transposed=flags[1])
                try:
                    out = fn(q, kc, vc, bt, lens, ks, vs, **kw)
                    err = (out.float() - ref).abs().max().item()
                    t = triton.testing.do_bench(lambda: fn(q, kc, vc, bt, lens, ks, vs, **kw),
                                                warmup=10, rep=60)
                    results.append((t, f"{block_n}/{warps}/{stages}", err))
                except Exception as error:  # a variant Triton cannot compile: say so, go on
                    results.append((float("inf"), f"{block_n}/{warps}/{stages}",
                                    f"{type(error).__name__}: {str(error)[:120]}"))
            results.sort(key=lambda r: r[0])
            for t, tile, err in results[:3]:
                print(f"    {name:11s} {tile:8s} {1e3 * t:7.1f} us {read / t / 1e9:5.2f} TB/s, "
                      f"max error {err}", flush=True)
            if results[0][0] == float("inf"):
                print(f"    {name}: {results[0][2]}", flush=True)
        q = kc = vc = None  # the next case allocates its own
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
