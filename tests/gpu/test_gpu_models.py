"""GPU checks of the model zoo beyond Qwen3-0.6B. Skipped without CUDA: CI has no GPU.

Run on a GPU machine with `PYTHONPATH=src python3 -m pytest tests/gpu/test_gpu_models.py -q`.

- Qwen2.5-0.5B's real shape (head_dim 64, 14 query heads over 2 KV heads, biased q/k/v) with
  random weights, bf16, against transformers' Qwen2ForCausalLM;
- Qwen3-8B from configs/Qwen3-8B/config.json alone with load_format="dummy": it builds, its
  logits are finite, and it generates with CUDA graphs.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

REPO = Path(__file__).resolve().parents[2]

# Qwen/Qwen2.5-0.5B-Instruct's config.json numbers.
QWEN25_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                  num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                  max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                  tie_word_embeddings=True, use_sliding_window=False, sliding_window=32768,
                  max_window_layers=21, bos_token_id=151643, eos_token_id=151645)


@pytest.fixture(scope="module")
def qwen25_random_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import AutoModelForCausalLM, Qwen2Config

    path = tmp_path_factory.mktemp("qwen2.5-0.5b-random")
    config = Qwen2Config(**QWEN25_05B)
    config.architectures = ["Qwen2ForCausalLM"]
    torch.manual_seed(0)
    with torch.device("cuda"):  # random init of 0.5B parameters: seconds here, not on the host
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():  # transformers starts biases at 0; trained Qwen2 k biases are large
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.5)
    model.save_pretrained(path, safe_serialization=True)
    del model
    torch.cuda.empty_cache()
    return path


def test_qwen25_05b_shape_logits_match_transformers(qwen25_random_checkpoint: Path) -> None:
    from helpers_models import assert_prefill_logits_match_transformers
    from transformers import AutoModelForCausalLM

    path = qwen25_random_checkpoint
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    assert_prefill_logits_match_transformers(path, hf)

def test_qwen3_8b_dummy_weights_run_with_cuda_graphs() -> None:
    from myvllm import LLM, SamplingParams

    llm = LLM(str(REPO / "configs" / "Qwen3-8B"), load_format="dummy", max_model_length=1024,
              max_num_batched_tokens=4096, num_kvcache_blocks=1024, max_num_sequences=16)
    try:
        assert llm.tokenizer is None and llm.model_runner.graphs.sizes("decode")
        params = dict(llm.model_runner.model.named_parameters())  # type: ignore[attr-defined]
        assert sum(p.numel() for p in params.values()) == pytest.approx(8.19e9, rel=0.01)
        assert next(iter(params.values())).dtype == torch.bfloat16
        # Logits of every eager step (the prefills; decode replays a captured graph).
        finite: list[bool] = []
        model = llm.model_runner.model
        compute_logits = model.compute_logits

        def checked(hidden: torch.Tensor) -> torch.Tensor | None:
            logits = compute_logits(hidden)
            if logits is not None:
                finite.append(bool(torch.isfinite(logits).all()))
            return logits

        model.compute_logits = checked  # type: ignore[method-assign]
        rng = random.Random(0)
        prompts = [[rng.randint(0, 150000) for _ in range(n)] for n in (5, 200, 37, 900)]
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32,
                                                    ignore_eos=True), use_tqdm=False)
        assert finite and all(finite)
        assert all(len(o["token_ids"]) == 32 for o in outs)
        assert all(0 <= t < 151936 for o in outs for t in o["token_ids"])
        assert len({tuple(o["token_ids"]) for o in outs}) > 1  # the input matters
    finally:
        llm.exit()
