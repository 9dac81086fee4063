"""Qwen2/Qwen2.5 (biased q/k/v, no q/k norm) against transformers' Qwen2ForCausalLM.

test_models_vs_hf.py runs the tiny tied "qwen2" kind through prefill, a cached prefix and
decode. Here: the engine's greedy tokens with a prefix hit (untied embeddings), the same under
tensor parallelism 2 over gloo (the q/k/v biases cut by heads), a GGUF file written from the
same weights, and the sliding window refused.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from helpers_models import (build_hf_model, build_tiny_checkpoint, hf_greedy, load_hf_reference,
                            load_ours, prefill_context, random_prompts, tiny_config)

from myvllm import LLM, SamplingParams
from myvllm.utils.context import forward_context
from myvllm.utils.hf_config import load_hf_config

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
ENGINE_KW = dict(block_size=4, num_kvcache_blocks=64, max_model_length=64,
                 max_num_batched_tokens=128)


@pytest.fixture(scope="module")
def untied(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint("qwen2", tmp_path_factory.mktemp("qwen2"), seed=3,
                                 tie_word_embeddings=False)


def _greedy_with_prefix_hit(llm: LLM, hf: object) -> None:
    """Two prompts sharing 16 tokens, one after the other: the second reuses 4 cached blocks;
    both give transformers' greedy tokens."""
    shared = random_prompts([16], seed=5)[0]
    prompts = [shared + [3, 4, 5], shared + [9, 8]]
    outs = [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in prompts]
    assert [o["num_cached_tokens"] for o in outs] == [0, 16]
    for prompt, out in zip(prompts, outs):
        assert out["token_ids"] == hf_greedy(hf, prompt, GREEDY.max_tokens)


def test_engine_greedy_with_prefix_hit_matches_transformers(untied: Path) -> None:
    hf = load_hf_reference(untied)
    assert not hf.config.tie_word_embeddings
    assert hf.model.layers[0].self_attn.k_proj.bias is not None
    llm = LLM(str(untied), **ENGINE_KW)
    try:
        _greedy_with_prefix_hit(llm, hf)
    finally:
        llm.exit()


@pytest.mark.slow
def test_tp2_greedy_with_prefix_hit_matches_transformers(untied: Path) -> None:
    llm = LLM(str(untied), tensor_parallel_size=2, **ENGINE_KW)
    try:
        _greedy_with_prefix_hit(llm, load_hf_reference(untied))
    finally:
        llm.exit()


def test_sliding_window_is_refused() -> None:
    from myvllm.models.qwen2 import Qwen2ForCausalLM

    config = tiny_config("qwen2", use_sliding_window=True, sliding_window=8)
    with pytest.raises(ValueError, match="use_sliding_window=True is not supported"):
        Qwen2ForCausalLM(config)


# llama.cpp's tensor names for the HF names of one decoder layer (its qwen2 converter keeps
# q/k rows in the HF order, unlike its llama converter).
GGUF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
GGUF_GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight",
                     "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}


def write_qwen2_gguf(hf_model: torch.nn.Module, path: Path) -> None:
    """The model as a float32 GGUF file with llama.cpp's qwen2 names and metadata."""
    import gguf

    config = hf_model.config
    writer = gguf.GGUFWriter(str(path), arch="qwen2")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    # transformers takes the vocabulary size from the token list, as for a real file.
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"<{i}>" for i in range(config.vocab_size)])
    for name, tensor in hf_model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # a tied file has no output.weight
        if name.startswith("model.layers."):
            layer, rest = name[len("model.layers."):].split(".", 1)
            gguf_name = f"blk.{layer}.{GGUF_LAYER_NAMES[rest]}"
        else:
            gguf_name = GGUF_GLOBAL_NAMES[name]
        writer.add_tensor(gguf_name, tensor.detach().float().numpy().astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@torch.no_grad()
@pytest.mark.parametrize("tied", [True, False])
def test_gguf_file_matches_transformers(tied: bool, tmp_path: Path) -> None:
    hf = build_hf_model("qwen2", seed=4, tie_word_embeddings=tied)
    path = tmp_path / "tiny-qwen2.gguf"
    write_qwen2_gguf(hf, path)

    config = load_hf_config(path)
    assert config.architectures == ["Qwen2ForCausalLM"]
    assert config.tie_word_embeddings == tied and config.vocab_size == 256
    ours = load_ours(path)
    prompts = random_prompts([9, 5], seed=6)
    lens = [len(p) for p in prompts]
    with forward_context(prefill_context(lens)):
        hidden = ours(torch.tensor(sum(prompts, [])), torch.cat([torch.arange(n) for n in lens]))
    got = ours.compute_logits(hidden)  # outside the context: every token's logits
    want = torch.cat([hf(torch.tensor([p])).logits[0] for p in prompts])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
