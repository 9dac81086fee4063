"""The fused-MoE kernel (kernels/fused_moe_kernel.py) against its PyTorch reference, and the
reference against a token-by-token loop in float64.

As in test_kernels.py: without a GPU the kernel runs in Triton's CPU interpreter (tests/
conftest.py sets TRITON_INTERPRET=1), in fp16 and fp32 only; shapes are small and odd (the
hidden and intermediate sizes are not multiples of the tiles). The real shapes in bf16 are
tests/gpu/test_fused_moe_gpu.py.
"""

from __future__ import annotations

import pytest
import torch
from helpers_kernels import DTYPES, HAS_CUDA

import myvllm.kernels.fused_ops as fused_ops
from myvllm.kernels.fused_reference import fused_moe_ref

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


@pytest.fixture(scope="module")
def device() -> torch.device:
    pytest.importorskip("triton")
    return torch.device("cuda" if HAS_CUDA else "cpu")


def make_moe(num_tokens: int, num_experts: int, top_k: int, hidden: int, inter: int,
             dtype: torch.dtype, device: torch.device, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """x, w13, w2 scaled to keep outputs O(1), and a top-k routing of random router logits."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5
    probs = torch.softmax(torch.randn(num_tokens, num_experts, generator=gen), dim=-1)
    weights, ids = probs.topk(top_k, dim=-1)
    return (x.to(device, dtype), w13.to(device, dtype), w2.to(device, dtype), weights.to(device),
            ids.to(device))  # fmt: skip


def test_fused_moe_ref_matches_a_token_loop() -> None:
    x, w13, w2, weights, ids = make_moe(9, 6, 3, 20, 12, torch.float64, torch.device("cpu"))
    want = torch.zeros_like(x)
    for t in range(len(x)):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = (w13[e] @ x[t]).chunk(2)
            want[t] += weights[t, j].double() * (w2[e] @ (torch.nn.functional.silu(gate) * up))
    torch.testing.assert_close(fused_moe_ref(x, w13, w2, weights, ids), want)


def random_routing(num_tokens: int, top_k: int, num_experts: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(num_tokens)
    return torch.stack([torch.randperm(num_experts, generator=gen)[:top_k]
                        for _ in range(num_tokens)])  # fmt: skip


@pytest.mark.parametrize("use_kernel", [False, True])
@pytest.mark.parametrize("num_tokens,top_k,block_m", [(1, 2, 16), (7, 3, 4), (40, 2, 16)])
def test_moe_align_block_size_groups_pairs_by_expert(device, num_tokens, top_k, block_m,
                                                     use_kernel) -> None:  # fmt: skip
    from myvllm.kernels.fused_moe_kernel import moe_align_block_size

    num_experts = 5
    ids = random_routing(num_tokens, top_k, num_experts).to(device)
    sorted_ids, block_expert, num_padded = moe_align_block_size(ids, block_m, num_experts,
                                                                use_kernel)  # fmt: skip
    num_pairs = ids.numel()
    counts = torch.bincount(ids.flatten().cpu(), minlength=num_experts)
    assert int(num_padded) == int(((counts + block_m - 1) // block_m * block_m).sum())
    assert sorted_ids.numel() % block_m == 0 and sorted_ids.numel() >= int(num_padded)
    used = sorted_ids[: int(num_padded)].cpu()
    real = used[used < num_pairs]
    assert sorted(real.tolist()) == list(range(num_pairs))  # every pair exactly once
    assert (sorted_ids[int(num_padded):] == num_pairs).all()  # the rest is padding
    flat = ids.flatten().cpu()
    for b in range(int(num_padded) // block_m):
        block = used[b * block_m:(b + 1) * block_m]
        block = block[block < num_pairs]
        assert len(block) > 0, "a block inside the padded total holds no pair"
        assert (flat[block] == int(block_expert[b])).all(), f"block {b} mixes experts"


@pytest.mark.parametrize("num_tokens,top_k,num_experts,block_m", [(1, 8, 128, 16), (32, 8, 128, 16),
                                                                  (9, 3, 6, 32), (2, 1, 3, 16)])
def test_moe_align_kernel_gives_the_pytorch_tensors(device, num_tokens, top_k, num_experts,
                                                    block_m) -> None:  # fmt: skip
    """The one-program alignment (decode batches) and the PyTorch ops agree bit for bit."""
    from myvllm.kernels.fused_moe_kernel import moe_align_block_size

    ids = random_routing(num_tokens, top_k, num_experts).to(device)
    by_ops = moe_align_block_size(ids, block_m, num_experts, use_kernel=False)
    by_kernel = moe_align_block_size(ids, block_m, num_experts, use_kernel=True)
    for name, a, b in zip(("sorted_ids", "block_expert", "num_padded"), by_ops, by_kernel):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,block_m", [(1, 16), (19, 32)])
def test_fused_moe_triton(device, dtype, num_tokens, block_m) -> None:
    from myvllm.kernels.fused_moe_kernel import MoeConfig, fused_moe_triton

    x, w13, w2, weights, ids = make_moe(num_tokens, 8, 2, 48, 40, dtype, device)
    out = fused_moe_triton(x, w13, w2, weights, ids, MoeConfig(block_m, 32, 32))
    ref = fused_moe_ref(x, w13, w2, weights, ids)
    assert out.dtype == dtype and out.shape == x.shape
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= TOL[dtype], f"max abs error {err} > {TOL[dtype]}"


def test_fused_moe_refuses_mismatched_shapes(device) -> None:
    from myvllm.kernels.fused_moe_kernel import fused_moe_triton

    x, w13, w2, weights, ids = make_moe(3, 4, 2, 16, 8, torch.float32, device)
    with pytest.raises(ValueError, match="shapes disagree"):
        fused_moe_triton(x, w13, w2[:, :, :4].contiguous(), weights, ids)
    with pytest.raises(ValueError, match=r"\[M, k\]"):
        fused_moe_triton(x, w13, w2, weights[:, :1], ids)


def test_fused_moe_dispatch(device, monkeypatch) -> None:
    """fused_ops.fused_moe runs the kernel when forced (or on CUDA), else the reference."""
    import myvllm.kernels.fused_moe_kernel as triton_impl

    x, w13, w2, weights, ids = make_moe(3, 4, 2, 16, 8, torch.float32, device)
    calls: list[str] = []
    real = triton_impl.fused_moe_triton
    monkeypatch.setattr(triton_impl, "fused_moe_triton",
                        lambda *a: calls.append("triton") or real(*a))  # fmt: skip
    monkeypatch.setenv("MYVLLM_FORCE_TRITON", "1")
    forced = fused_ops.fused_moe(x, w13, w2, weights, ids)
    monkeypatch.setenv("MYVLLM_FORCE_TRITON", "0")
    reference = fused_ops.fused_moe(x, w13, w2, weights, ids)
    assert calls == ["triton"]
    torch.testing.assert_close(forced, reference, atol=TOL[torch.float32], rtol=0)
