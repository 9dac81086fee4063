"""benchmarks/roofline.py: the bytes and FLOPs a step must move and do, counted by hand."""

from __future__ import annotations

from helpers_models import tiny_checkpoint

from benchmarks.roofline import ModelShape, step_work
from myvllm import LLM


def test_step_work_counts_weights_kv_and_causal_pairs() -> None:
    shape = ModelShape(weight_bytes=1000, matmul_params_per_token=10, kv_bytes_per_token=4,
                       attention_flops_per_pair=2, lm_head_params=5)
    # A 3-token prompt (pairs 1 + 2 + 3) and a decode row at length 10 (pairs 10).
    work = step_work(shape, [(3, 3), (1, 10)], sampled_rows=2)
    assert work.bytes_read == 1000 + (3 + 10) * 4  # the weights once, every context token
    assert work.bytes_written == 4 * 4  # the new tokens' K/V
    assert work.flops == 2 * 10 * 4 + 2 * 5 * 2 + 2 * (6 + 10)
    # 1 GB/s and 1 TFLOP/s: the 1,068 bytes take longer than the 132 FLOPs.
    assert abs(work.ideal_ms(1.0, 1.0) - 1068 / 1e9 * 1e3) < 1e-12
    # A chunk after a cached prefix: 4 new tokens see 6 earlier ones each, then 1..4.
    assert step_work(shape, [(4, 10)], 1).flops == 2 * 10 * 4 + 2 * 5 + 2 * (4 * 6 + 10)


def test_model_shape_reads_the_engine() -> None:
    llm = LLM(str(tiny_checkpoint("qwen3")), num_kvcache_blocks=16)
    shape = ModelShape.from_engine(llm)
    model, hf = llm.model_runner.model, llm.model_runner.hf_config
    every = {id(p): p for p in model.parameters()}.values()
    embed, head = model.model.embed_tokens.weight, model.lm_head.weight
    streamed = [p for p in every if p is not embed or p is head]
    assert shape.weight_bytes == sum(p.numel() * p.element_size() for p in streamed)
    assert shape.lm_head_params == head.numel()
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    itemsize = head.element_size()
    assert shape.kv_bytes_per_token == (2 * hf.num_hidden_layers * hf.num_key_value_heads
                                        * head_dim * itemsize)
    assert shape.attention_flops_per_pair == 4 * head_dim * hf.num_attention_heads * \
        hf.num_hidden_layers
    # Every 2-D weight but the LM head (and the embedding) is multiplied once per token.
    assert shape.matmul_params_per_token == sum(
        p.numel() for p in streamed if p.dim() >= 2 and p is not head)
