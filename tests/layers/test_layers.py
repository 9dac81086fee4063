"""Unit tests of the step-1 layers against plain PyTorch / HF transformers (CPU, tp=1)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers_models import LLAMA3_SCALING, tiny_config

from myvllm.layers.activation import SiluAndMul
from myvllm.layers.attention import Attention
from myvllm.layers.embedding_head import ParallelLMHead, VocabParallelEmbedding
from myvllm.layers.layernorm import RMSNorm
from myvllm.layers.rotary_embedding import get_rope
from myvllm.models import get_model_class
from myvllm.utils.context import Context, forward_context
from myvllm.models.config import rope_parameters


def test_silu_and_mul() -> None:
    x = torch.randn(5, 2 * 7)
    torch.testing.assert_close(SiluAndMul()(x), F.silu(x[:, :7]) * x[:, 7:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_matches_hf_and_fuses_residual(dtype: torch.dtype) -> None:
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    ours, ref = RMSNorm(32, eps=1e-6), Qwen3RMSNorm(32, eps=1e-6)
    with torch.no_grad():
        w = torch.rand(32) + 0.5
        ours.weight.copy_(w)
        ref.weight.copy_(w)
    ours, ref = ours.to(dtype), ref.to(dtype)
    x, residual = torch.randn(6, 32).to(dtype), torch.randn(6, 32).to(dtype)
    torch.testing.assert_close(ours(x), ref(x), atol=0, rtol=0)
    normed, new_residual = ours(x, residual)
    torch.testing.assert_close(
        new_residual, x + residual, atol=0, rtol=0, msg="residual = x + residual"
    )
    torch.testing.assert_close(
        normed, ref(x + residual), atol=0, rtol=0, msg="normed = norm(x + residual)"
    )
    assert normed.dtype == dtype and new_residual.dtype == dtype


@pytest.mark.parametrize("kind", ["llama", "llama3"])
def test_rope_matches_hf(kind: str) -> None:
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    config = tiny_config(kind)
    head_dim, n = 16, 40
    theta, scaling = rope_parameters(config)
    rope = get_rope(head_dim, config.max_position_embeddings, theta, scaling)
    positions = torch.randint(0, config.max_position_embeddings, (n,))
    q, k = torch.randn(n, 4, head_dim), torch.randn(n, 2, head_dim)
    cos, sin = LlamaRotaryEmbedding(config)(q, positions[None])
    # HF layout: [batch, heads, seq, head_dim]
    q_ref, k_ref = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    q_out, k_out = rope(positions, q, k)
    torch.testing.assert_close(q_out, q_ref[0].transpose(0, 1), atol=1e-5, rtol=0)
    torch.testing.assert_close(k_out, k_ref[0].transpose(0, 1), atol=1e-5, rtol=0)
    # Flat [N, H*D] inputs are accepted too and give the same result.
    q_flat, _ = rope(positions, q.reshape(n, -1), k.reshape(n, -1))
    torch.testing.assert_close(q_flat, q_out.reshape(n, -1))


def test_llama3_scaling_bands() -> None:
    plain = get_rope(16, 256, 10000.0, None)
    scaled = get_rope(16, 256, 10000.0, dict(LLAMA3_SCALING))

    def angles(rope) -> torch.Tensor:  # rotation angle per frequency band at position 1
        cos, sin = rope.cos_sin_cache[1].chunk(2)
        return torch.atan2(sin, cos)

    ratio = angles(plain) / angles(scaled)
    # wavelengths 6.3 | 19.9, 62.8 | 199 ... with bands <16 kept, 16..64 smoothed, >64 / factor 8
    torch.testing.assert_close(ratio[0], torch.tensor(1.0))
    assert 1.0 < ratio[1] < ratio[2] < 8.0
    torch.testing.assert_close(ratio[3:], torch.full((5,), 8.0))


def test_rope_table_stays_float32_under_model_to() -> None:
    rope = get_rope(16, 32, 500.0, None)
    holder = torch.nn.Module()
    holder.rope = rope
    try:
        holder.to(torch.bfloat16)
        assert rope.cos_sin_cache.dtype == torch.float32
        q = torch.randn(3, 2, 16, dtype=torch.bfloat16)
        q_out, _ = rope(torch.tensor([0, 5, 31]), q, q)
        assert q_out.dtype == torch.bfloat16
    finally:
        holder.float()


def test_get_rope_shares_the_table_and_rejects_unknown_scaling() -> None:
    a, b = get_rope(16, 64, 1e4, None), get_rope(16, 64, 1e4, None)
    assert a.cos_sin_cache is b.cos_sin_cache  # one table for every layer
    assert a.cos_sin_cache is not get_rope(16, 64, 1e6, None).cos_sin_cache
    # Moving one module (as model.to() does) must not move the table the others share.
    a.to("meta")
    assert a.cos_sin_cache.is_meta and not b.cos_sin_cache.is_meta
    assert not get_rope(16, 64, 1e4, None).cos_sin_cache.is_meta
    with pytest.raises(ValueError, match="yarn"):
        get_rope(16, 64, 1e4, {"rope_type": "yarn", "factor": 2.0})


def test_embedding_and_lm_head_prefill_keeps_last_tokens() -> None:
    emb, head = VocabParallelEmbedding(50, 8), ParallelLMHead(50, 8)
    with torch.no_grad():
        emb.weight.normal_()
        head.weight.normal_()
    ids = torch.tensor([3, 7, 49, 0, 5])
    torch.testing.assert_close(emb(ids), emb.weight[ids])
    hidden = torch.randn(5, 8)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    with forward_context(Context(
        is_prefill=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=3, max_seqlen_k=3
    )):
        logits = head(hidden)
    torch.testing.assert_close(logits, hidden[[1, 4]] @ head.weight.T)
    # Decode (not prefill): one row per input row.
    torch.testing.assert_close(head(hidden), hidden @ head.weight.T)


def test_prefill_lm_head_rows_pad_to_a_power_of_two_with_row_0() -> None:
    """On a GPU the LM head of a prefill step runs at a power-of-two row count (a shape the
    decode graphs already ran); the padding repeats row 0 and the caller cuts it off."""
    from myvllm.kernels.linear_kernels import pad_rows_to_power_of_two

    assert pad_rows_to_power_of_two(torch.tensor([1, 4, 5])).tolist() == [1, 4, 5, 0]
    assert pad_rows_to_power_of_two(torch.tensor([1, 4])).tolist() == [1, 4]
    assert pad_rows_to_power_of_two(torch.tensor([6])).tolist() == [6]
    assert pad_rows_to_power_of_two(torch.tensor([], dtype=torch.int64)).tolist() == []
    many = torch.arange(65)  # the last rows of 65 sequences of one token
    assert pad_rows_to_power_of_two(many).tolist() == list(range(65)) + [0] * 63


def _sdpa_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, scale=scale
    )
    return o.transpose(0, 1)


def test_attention_prefill_without_cache_is_causal_per_sequence() -> None:
    attn = Attention(num_heads=4, head_dim=8, scale=8**-0.5, num_kv_heads=2)
    q, k, v = torch.randn(9, 4, 8), torch.randn(9, 2, 8), torch.randn(9, 2, 8)
    cu = torch.tensor([0, 3, 9], dtype=torch.int32)
    with forward_context(Context(
        is_prefill=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=6, max_seqlen_k=6
    )):
        out = attn(q, k, v)
    assert out.shape == (9, 32)
    want = torch.cat([_sdpa_causal(q[a:b], k[a:b], v[a:b], 8**-0.5) for a, b in [(0, 3), (3, 9)]])
    torch.testing.assert_close(out, want.reshape(9, 32), atol=1e-5, rtol=0)


def test_attention_stores_kv_and_decodes_from_cache() -> None:
    attn = Attention(num_heads=4, head_dim=8, scale=0.3, num_kv_heads=2)
    attn.k_cache, attn.v_cache = torch.zeros(4, 2, 2, 8), torch.zeros(4, 2, 2, 8)
    q, k, v = torch.randn(3, 4, 8), torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    cu = torch.tensor([0, 3], dtype=torch.int32)
    slots = torch.tensor([6, 7, 2], dtype=torch.int32)  # blocks [3, 1]
    with forward_context(Context(is_prefill=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=3,
                         max_seqlen_k=3, slot_mapping=slots)):  # fmt: skip
        attn(q, k, v)
    torch.testing.assert_close(attn.k_cache[3], k[:2])
    torch.testing.assert_close(attn.v_cache[1, 0], v[2])
    # The last token decoding against the cache = the last row of the prefill.
    with forward_context(Context(is_prefill=False, slot_mapping=torch.tensor([-1], dtype=torch.int32),
                         context_lens=torch.tensor([3], dtype=torch.int32),
                         block_tables=torch.tensor([[3, 1]], dtype=torch.int32))):  # fmt: skip
        out = attn(q[2:], k[2:], v[2:])
    torch.testing.assert_close(
        out, _sdpa_causal(q, k, v, 0.3)[2:].reshape(1, 32), atol=1e-5, rtol=0
    )


def test_attention_outside_a_forward_context_raises() -> None:
    attn = Attention(num_heads=2, head_dim=4, scale=0.5, num_kv_heads=1)
    with pytest.raises(RuntimeError, match="forward_context"):
        attn(torch.randn(1, 2, 4), torch.randn(1, 1, 4), torch.randn(1, 1, 4))


def test_get_model_class() -> None:
    assert get_model_class(["Qwen3ForCausalLM"]).__name__ == "Qwen3ForCausalLM"
    assert get_model_class(["LlamaForCausalLM"]).__name__ == "LlamaForCausalLM"
    with pytest.raises(ValueError, match=r"MistralForCausalLM.*supported.*LlamaForCausalLM"):
        get_model_class(["MistralForCausalLM"])
