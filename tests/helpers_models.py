"""Tiny random Qwen3 / Llama / Qwen2 checkpoints, written by HF transformers, for CPU tests.

    path = tiny_checkpoint("qwen3")        # cached per process: built once, reused by all tests
    path = build_tiny_checkpoint("llama3", some_dir)   # fresh copy in a directory of your own

Kinds (all: hidden 64, 2 layers, 4 heads, 2 KV heads, head_dim 16, vocab 256, MLP 128):

    qwen3        Qwen3, tied embeddings
    qwen3_bias   Qwen3, untied, attention_bias=True
    llama        Llama, untied, plain RoPE
    llama3       Llama, tied, "llama3" RoPE scaling (all three frequency bands hit), with
                 attention and MLP biases
    qwen2        Qwen2, tied, q/k/v biases (head_dim = hidden_size / heads)
    qwen3_moe    Qwen3-MoE, untied, 3 layers: layer 0 dense (mlp_only_layers), layers 1-2
                 with 8 experts (intermediate 32), top-2, norm_topk_prob

Weights are random but NOT HF's init: HF sets every norm weight to 1 and uses std 0.02, under
which swapping q_norm/k_norm or forgetting a norm changes nothing visible. Here norms are
drawn in [0.5, 1.5] and matrices are scaled to keep activations O(1).

Each checkpoint dir also gets a byte-level tokenizer (256 byte tokens; eos = token 0), so
engine tests can use string prompts. Tokens map 1:1 to UTF-8 bytes.
"""

from __future__ import annotations

import atexit
import math
import random
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from myvllm.utils.context import Context

TINY_DIMS: dict[str, Any] = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=256,
    intermediate_size=128,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=0,
    pad_token_id=0,
)

# llama3 scaling with head_dim 16, theta 10000: wavelengths 6.3, 19.9, 62.8, 199, ...; with
# original context 64 and factors 1/4, the bands are <16 (kept), 16..64 (smoothed), >64 (scaled).
LLAMA3_SCALING: dict[str, Any] = dict(
    rope_type="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=64,
)

KINDS = ("qwen3", "qwen3_bias", "llama", "llama3", "qwen2", "qwen3_moe")


def tiny_config(kind: str, **overrides: Any) -> Any:
    """The transformers config of a tiny model of ``kind`` (see the module docstring)."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    dims = dict(TINY_DIMS)
    if kind == "qwen3":
        dims.update(tie_word_embeddings=True, rope_theta=10000.0)
        cls: Any = Qwen3Config
    elif kind == "qwen3_bias":
        dims.update(tie_word_embeddings=False, attention_bias=True, rope_theta=10000.0)
        cls = Qwen3Config
    elif kind == "llama":
        dims.update(tie_word_embeddings=False, rope_theta=10000.0)
        cls = LlamaConfig
    elif kind == "llama3":
        dims.update(
            tie_word_embeddings=True,
            attention_bias=True,
            mlp_bias=True,
            rope_theta=10000.0,
            rope_scaling=dict(LLAMA3_SCALING),
        )
        cls = LlamaConfig
    elif kind == "qwen2":
        dims.update(tie_word_embeddings=True, rope_theta=10000.0)
        del dims["head_dim"]  # Qwen2 configs have none: 64 / 4 heads = 16
        cls = Qwen2Config
    elif kind == "qwen3_moe":
        dims.update(tie_word_embeddings=False, rope_theta=10000.0, num_hidden_layers=3,
                    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                    norm_topk_prob=True, mlp_only_layers=[0], decoder_sparse_step=1)
        cls = Qwen3MoeConfig
    else:
        raise ValueError(f"unknown tiny model kind {kind!r}; known: {KINDS}")
    dims.update(overrides)
    return cls(**dims)


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if "norm" in name:
            p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
        elif name.endswith("bias"):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
        elif "embed_tokens" in name:
            p.copy_(torch.randn(p.shape, generator=gen))
        else:  # [out, in] matrices: std 1/sqrt(in) keeps the output scale of the input
            p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))


def build_hf_model(kind: str, seed: int = 0, **overrides: Any) -> Any:
    from transformers import AutoModelForCausalLM

    config = tiny_config(kind, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    randomize_(model.float(), seed)
    return model.eval()


def save_byte_tokenizer(out_dir: str | Path, eos_token_id: int = 0) -> None:
    """A 256-token byte-level tokenizer (token i = byte i), saved with save_pretrained."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    alphabet = pre_tokenizers.ByteLevel.alphabet()  # the 256 printable stand-ins for bytes
    # Order the stand-ins by the byte they represent, so token id == byte value.
    char_of_byte = _bytes_to_unicode()
    vocab = {char_of_byte[b]: b for b in range(256)}
    assert set(vocab) == set(alphabet)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=char_of_byte[eos_token_id])
    fast.save_pretrained(str(out_dir))


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (what ByteLevel pre-tokenization emits)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def build_tiny_checkpoint(kind: str, out_dir: str | Path, seed: int = 0, **overrides: Any) -> Path:
    """Write a tiny random checkpoint (config.json, model.safetensors, tokenizer) to out_dir."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    build_hf_model(kind, seed, **overrides).save_pretrained(str(out))
    save_byte_tokenizer(out, eos_token_id=TINY_DIMS["eos_token_id"])
    return out


_CACHE_ROOT: Path | None = None
_CACHE: dict[str, Path] = {}


def tiny_checkpoint(kind: str) -> Path:
    """Path of the process-wide tiny checkpoint of ``kind`` (built on first use; read-only)."""
    global _CACHE_ROOT
    if kind not in _CACHE:
        if _CACHE_ROOT is None:
            _CACHE_ROOT = Path(tempfile.mkdtemp(prefix="myvllm-tiny-"))
            atexit.register(shutil.rmtree, _CACHE_ROOT, True)
        _CACHE[kind] = build_tiny_checkpoint(kind, _CACHE_ROOT / kind)
    return _CACHE[kind]


def load_hf_reference(path: str | Path) -> Any:
    """The HF transformers model of a checkpoint dir, fp32, eager attention (the oracle)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), attn_implementation="eager")
    return model.float().eval()


def load_ours(path: str | Path) -> Any:
    """Our model for a checkpoint dir or .gguf, fp32 on CPU, loaded through our loader."""
    from myvllm.models import get_model_class
    from myvllm.utils.hf_config import load_hf_config
    from myvllm.utils.loader import load_model

    config = load_hf_config(path)
    model = get_model_class(config.architectures)(config)
    load_model(model, path)
    return model.eval()


def prefill_context(seq_lens: list[int], slot_mapping: torch.Tensor | None = None) -> Context:
    """The forward_context of a prefill of sequences of these lengths with no cached prefix;
    with slot_mapping, their K/V is also written to the cache."""
    from myvllm.utils.context import Context

    cu = torch.tensor([0] + list(torch.tensor(seq_lens).cumsum(0).tolist()), dtype=torch.int32)
    return Context(
        is_prefill=True,
        cu_seqlens_q=cu,
        cu_seqlens_k=cu,
        max_seqlen_q=max(seq_lens),
        max_seqlen_k=max(seq_lens),
        slot_mapping=slot_mapping,
    )


def hf_greedy(hf_model: Any, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' generate, greedy, with eos disabled (our side uses ignore_eos)."""
    hf_model.generation_config.eos_token_id = None
    out = hf_model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                            dtype=torch.long), max_new_tokens=max_new_tokens, do_sample=False,
                            pad_token_id=0)
    return out[0, len(prompt):].tolist()


def record_preemptions(llm: Any) -> list[int]:
    """The seq_id of every sequence the engine's scheduler preempts from now on, in order
    (the scheduler still preempts them)."""
    preempted: list[int] = []
    preempt = llm.scheduler.preempt

    def counting_preempt(seq: Any) -> None:
        preempted.append(seq.seq_id)
        preempt(seq)

    llm.scheduler.preempt = counting_preempt
    return preempted


def random_prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    """Prompts of these lengths, token ids 1..255 (inside every tiny vocabulary)."""
    rng = random.Random(seed)
    return [[rng.randint(1, 255) for _ in range(n)] for n in lengths]


def assert_prefill_logits_match_transformers(path: Path, hf: Any, top_5: bool = True) -> None:
    """GPU, bf16: our model built from the checkpoint at `path` against the transformers
    model `hf` (on the GPU) on three prompts of 37, 300 and 5 random tokens in one varlen
    batch. bf16 through many layers: compare each last-token logit vector's direction
    (cosine > 0.99) and, with top_5, that our top 5 tokens hold transformers' top token."""
    from myvllm.layers.fused import fuse_layer_ops
    from myvllm.models import get_model_class
    from myvllm.utils.context import Context, forward_context
    from myvllm.utils.hf_config import load_hf_config
    from myvllm.utils.loader import load_model

    config = load_hf_config(path)
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            ours = get_model_class(config.architectures)(config)
    finally:
        torch.set_default_dtype(torch.float32)
    fuse_layer_ops(ours)  # as build_model does on a GPU
    load_model(ours, path)
    rng = random.Random(0)
    lens = [37, 300, 5]
    prompts = [[rng.randint(0, 150000) for _ in range(n)] for n in lens]
    ids = torch.tensor(sum(prompts, []), device="cuda")
    positions = torch.tensor([p for n in lens for p in range(n)], device="cuda")
    cu = torch.tensor([0, 37, 337, 342], dtype=torch.int32, device="cuda")
    with torch.inference_mode(), forward_context(Context(is_prefill=True, cu_seqlens_q=cu,
                                                 cu_seqlens_k=cu, max_seqlen_q=300,
                                                 max_seqlen_k=300)):  # fmt: skip
        logits = ours.compute_logits(ours(ids, positions)).float()
    with torch.inference_mode():
        for i, prompt in enumerate(prompts):
            ref = hf(torch.tensor([prompt], device="cuda")).logits[0, -1].float()
            cos = torch.nn.functional.cosine_similarity(logits[i], ref, dim=0).item()
            assert cos > 0.99, f"prompt {i}: cosine {cos:.4f}"
            if top_5:
                assert ref.argmax().item() in set(logits[i].topk(5).indices.tolist())
