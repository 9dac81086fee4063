"""Prefix caching across requests, on the real engine: the second call reports num_cached_tokens.

    uv run python examples/prefix_cache_demo.py                    # tiny random Qwen3, seconds
    uv run python examples/prefix_cache_demo.py --model bundled    # SmolLM2-135M, real text

Three generate() calls on ONE engine, one after the other (nothing is alive in between):

    1. P1 = shared + question 1      cold: num_cached_tokens = 0
    2. P2 = shared + question 2      the full blocks of `shared` come from the cache
    3. P1 again                      every full block of P1 is cached, but the last block is
                                     recomputed (its last token's logits give the first new
                                     token), and the completion equals call 1's: same tokens
                                     with and without a cache hit (greedy)

--model tiny builds a random 2-layer Qwen3 with transformers in a temporary folder (no
tokenizer: prompts are token ids and there is no text). --model bundled runs the SmolLM2 GGUF
that ships with the environment (loading it takes a while on a CPU). Any other value is a
checkpoint path or hub id.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))  # run without install

SHARED_TEXT = ("You are a patient teacher of systems programming. Answer every question in "
               "one short sentence, with no lists and no code. ") * 3


def build_tiny_qwen3(folder: str) -> str:
    """A random Qwen3 with 2 layers and a 512-token vocabulary, saved as safetensors."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         vocab_size=512, max_position_embeddings=512, tie_word_embeddings=True,
                         eos_token_id=0, bos_token_id=1)
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():  # HF's init (std 0.02, norms 1) makes a random model repeat itself
        for name, param in model.named_parameters():
            if param.dim() == 1:
                param.uniform_(0.5, 1.5)
            else:
                param.normal_(0.0, param.shape[-1] ** -0.5)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny",
                        help="'tiny' (random Qwen3), 'bundled' (SmolLM2 GGUF), or a path/hub id")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--no-prefix-caching", action="store_true")
    args = parser.parse_args(argv)

    from myvllm import LLM, SamplingParams

    with tempfile.TemporaryDirectory() as tmp:
        model = {"tiny": None, "bundled": None}.get(args.model, args.model)
        if args.model == "tiny":
            model = build_tiny_qwen3(tmp)
        llm = LLM(model, block_size=args.block_size, max_model_length=256,
                  max_num_batched_tokens=1024, max_num_sequences=8,
                  enable_prefix_caching=not args.no_prefix_caching)
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        if llm.tokenizer is not None:  # chat-formatted text, as main.py sends it
            p1, p2 = (llm.tokenizer.encode(llm.tokenizer.apply_chat_template(
                [{"role": "user", "content": SHARED_TEXT + q}], tokenize=False,
                add_generation_prompt=True)) for q in ("What is a KV cache?",
                                                       "What is a block table?"))
        else:
            rng = random.Random(0)
            shared = [rng.randrange(2, 512) for _ in range(61)]
            p1, p2 = shared + [7, 8, 9], shared + [10, 11, 12, 13]  # P1: 64 tokens
        common = next((i for i, (s, t) in enumerate(zip(p1, p2)) if s != t), min(len(p1), len(p2)))
        print(f"block_size={args.block_size}; P1 has {len(p1)} tokens, P2 has {len(p2)}, "
              f"they share the first {common}")

        results = []
        for label, prompt in (("call 1: P1", p1), ("call 2: P2", p2), ("call 3: P1", p1)):
            out = llm.generate([prompt], params, use_tqdm=False)[0]
            results.append(out)
            computed = len(prompt) - out["num_cached_tokens"]
            text = f"  text={out['text']!r}" if out["text"] is not None else ""
            print(f"{label}  num_cached_tokens={out['num_cached_tokens']:<4} "
                  f"computed={computed:<4} completion={out['token_ids']}{text}")
        full, rest = divmod(len(p1), args.block_size)
        if args.no_prefix_caching:
            print("prefix caching is off: every call computes its whole prompt")
        elif rest:
            print(f"P1 = {full} full blocks + {rest} tokens: the full blocks hit in call 3")
        else:
            print(f"P1 = exactly {full} full blocks: all of them are cached, so call 3 "
                  "recomputes the last one (a prefill must compute at least one token)")
        same = results[0]["token_ids"] == results[2]["token_ids"]
        print(f"call 3 completion equals call 1 (cache hit vs cold): {same}")
        llm.exit()
    if not same:
        raise SystemExit("a cache hit changed the greedy output: this is a bug")


if __name__ == "__main__":
    main()
