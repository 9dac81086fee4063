"""The bundled SmolLM2-135M GGUF through our loader equals HF transformers loading the same file.

This checks the GGUF path end to end: tensor names mapped to HF names, Q4_1/Q8_0
dequantization, the llama.cpp q/k permutation undone, tied embeddings, config from metadata.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers_models import load_ours, prefill_context

from myvllm.utils.context import forward_context
from myvllm.utils.hf_config import gguf_parsed_once, load_tokenizer
from myvllm.utils.model_path import resolve_model_path

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gguf_path() -> str:
    return resolve_model_path(None)


@torch.no_grad()
def test_bundled_gguf_matches_transformers(gguf_path: str) -> None:
    from transformers import AutoModelForCausalLM

    # Our side parses the file once, as LLMEngine does (the test below checks that sharing);
    # transformers, the oracle, loads it on its own, outside the block.
    with gguf_parsed_once():
        tokenizer = load_tokenizer(gguf_path)
        ours = load_ours(gguf_path)
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": "What is the capital of France?"}],
            tokenize=False,
            add_generation_prompt=True,
        ),  # fmt: skip
        "The quick brown fox",
    ]
    token_lists = [tokenizer(p)["input_ids"] for p in prompts]

    assert ours.config.num_hidden_layers == 30 and ours.config.tie_word_embeddings
    lens = [len(t) for t in token_lists]
    with forward_context(prefill_context(lens)):
        hidden = ours(
            torch.tensor(sum(token_lists, [])), torch.cat([torch.arange(n) for n in lens])
        )
    got = ours.compute_logits(hidden).split(lens)
    del ours

    folder, name = str(Path(gguf_path).parent), Path(gguf_path).name
    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, attn_implementation="eager")
    hf = hf.eval()
    assert next(hf.parameters()).dtype == torch.float32
    for tokens, logits in zip(token_lists, got):
        want = hf(torch.tensor([tokens])).logits[0]
        err, scale = (logits - want).abs().max().item(), want.abs().max().item()
        print(f"max |ours - HF| = {err:.3g}, max |logit| = {scale:.3g}")
        torch.testing.assert_close(logits, want, atol=1e-3, rtol=1e-4)
        assert torch.equal(logits.argmax(-1), want.argmax(-1))


def test_config_tokenizer_and_weights_share_one_gguf_parse(gguf_path: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """LLMEngine builds inside gguf_parsed_once: transformers' config and tokenizer loads and
    our weight loader then parse the file once between them (each parse is ~6 s on 2 cores)."""
    import gguf

    from myvllm.utils.hf_config import load_hf_config

    parses: list[str] = []

    class CountingReader(gguf.GGUFReader):  # type: ignore[misc,valid-type]
        def __init__(self, path, *args, **kwargs):
            parses.append(str(path))
            super().__init__(path, *args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", CountingReader)
    with gguf_parsed_once():
        load_hf_config(gguf_path)
        load_tokenizer(gguf_path)
        model = load_ours(gguf_path)
        assert gguf.GGUFReader(gguf_path) is gguf.GGUFReader(gguf_path)
    assert len(parses) == 1, parses
    assert gguf.GGUFReader is CountingReader  # put back on the way out
    assert model.config.num_hidden_layers == 30
