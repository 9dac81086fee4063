"""The fused-MoE kernel and Qwen3-MoE on a GPU. Skipped without CUDA: CI has no GPU.

Run on a GPU machine with
`PYTHONPATH=src python3 -m pytest tests/gpu/test_fused_moe_gpu.py -q`.

- the kernel in bf16 at Qwen3-30B-A3B's expert shape (128 experts, 8 active, hidden 2048,
  expert intermediate 768; 384 = that over 2 ranks) against the per-expert reference, for
  1 to 4096 tokens;
- the one-program alignment (decode batches) gives the PyTorch ops' tensors;
- inside a CUDA graph it gives the eager call's bits (the engine captures decode steps), with
  either alignment (1 and 8 tokens: the kernel; 64: the PyTorch ops);
- two layers of Qwen3-30B-A3B's shape with random weights against transformers;
- the tiny random Qwen3-MoE through the engine: CUDA-graph tokens equal eager tokens.
"""

from __future__ import annotations


import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# Qwen3-30B-A3B's config.json (the hub's), the values these tests use.
QWEN3_30B_A3B = dict(
    hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_attention_heads=32,
    num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
    norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], rope_theta=1e6,
    rms_norm_eps=1e-6, vocab_size=151936, max_position_embeddings=40960,
    tie_word_embeddings=False, hidden_act="silu",
)  # fmt: skip


def make_experts(num_tokens: int, inter: int = 768, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """bf16 x, w13, w2 at the 30B-A3B shape (std 1/sqrt(fan-in)) and a softmax top-8 routing."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    e, h = 128, 2048
    x = torch.randn(num_tokens, h, device="cuda", generator=gen).bfloat16()
    w13 = (torch.randn(e, 2 * inter, h, device="cuda", generator=gen) / h**0.5).bfloat16()
    w2 = (torch.randn(e, h, inter, device="cuda", generator=gen) / inter**0.5).bfloat16()
    logits = torch.randn(num_tokens, e, device="cuda", generator=gen)
    weights, ids = torch.softmax(logits, -1).topk(8, dim=-1)
    return x, w13, w2, weights / weights.sum(-1, keepdim=True), ids


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.mark.parametrize("inter", [768, 384])
@pytest.mark.parametrize("num_tokens", [1, 2, 8, 64, 512, 4096])
def test_fused_moe_bf16_real_shapes(num_tokens: int, inter: int) -> None:
    from myvllm.kernels.fused_reference import fused_moe_ref
    from myvllm.kernels.fused_moe_kernel import fused_moe_triton

    x, w13, w2, weights, ids = make_experts(num_tokens, inter)
    out = fused_moe_triton(x, w13, w2, weights, ids)
    ref = fused_moe_ref(x, w13, w2, weights, ids)
    # The same roundings as the reference; what differs is the order of the float32 sums.
    assert rel_err(out, ref) < 1e-2


@pytest.mark.parametrize("block_m", [16, 32, 64])
@pytest.mark.parametrize("num_tokens", [1, 8, 32])
def test_align_kernel_gives_the_pytorch_tensors(num_tokens: int, block_m: int) -> None:
    from myvllm.kernels.fused_moe_kernel import moe_align_block_size

    ids = make_experts(num_tokens)[4]
    by_ops = moe_align_block_size(ids, block_m, 128, use_kernel=False)
    by_kernel = moe_align_block_size(ids, block_m, 128, use_kernel=True)
    for name, a, b in zip(("sorted_ids", "block_expert", "num_padded"), by_ops, by_kernel):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("num_tokens", [1, 8, 64])
def test_fused_moe_in_a_cuda_graph_gives_eager_bits(num_tokens: int) -> None:
    from myvllm.kernels.fused_moe_kernel import fused_moe_triton

    x, w13, w2, weights, ids = make_experts(num_tokens)
    eager = fused_moe_triton(x, w13, w2, weights, ids)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fused_moe_triton(x, w13, w2, weights, ids)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fused_moe_triton(x, w13, w2, weights, ids)
    # New routing through the same graph: the sort and the padding run on the device.
    _, _, _, new_weights, new_ids = make_experts(num_tokens, seed=1)
    weights.copy_(new_weights)
    ids.copy_(new_ids)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, fused_moe_triton(x, w13, w2, weights, ids))
    assert not torch.equal(captured, eager)


def test_two_layers_of_qwen3_30b_a3b_match_transformers(tmp_path) -> None:
    from helpers_models import assert_prefill_logits_match_transformers
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(**QWEN3_30B_A3B, num_hidden_layers=2,
                            architectures=["Qwen3MoeForCausalLM"])  # fmt: skip
    torch.manual_seed(0)
    with torch.device("cuda"):
        hf = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    hf.save_pretrained(tmp_path)
    # Only the direction: the top-token check has not been run on this shape.
    assert_prefill_logits_match_transformers(tmp_path, hf, top_5=False)

def test_tiny_qwen3_moe_graph_tokens_equal_eager() -> None:
    from helpers_models import random_prompts, tiny_checkpoint

    from myvllm import LLM, SamplingParams

    path = str(tiny_checkpoint("qwen3_moe"))
    prompts = random_prompts([5, 40, 17, 3, 90, 11], seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    # A fixed cache (tests/gpu/conftest.py: not millions of tiny blocks).
    args = dict(max_model_length=256, max_num_batched_tokens=1024, max_num_sequences=8,
                num_kvcache_blocks=256)
    outs = []
    for eager in (True, False):
        llm = LLM(path, enforce_eager=eager, **args)
        outs.append([o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)])
        llm.exit()
    assert outs[0] == outs[1]
