"""Our Qwen3/Llama (loaded through our loader) against HF transformers on tiny random weights.

Three ways of running the same tokens must all give HF's logits:
  1. prefill of a batch of prompts with different lengths (flat batch, cu_seqlens, no cache);
  2. prefill of the prompts' last tokens over a cached prefix (paged KV cache, block_tables,
     positions starting at num_cached_tokens);
  3. decode steps after that, one token per sequence.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers_models import KINDS, load_hf_reference, load_ours, prefill_context, tiny_checkpoint

from myvllm.layers.attention import Attention
from myvllm.utils.context import Context, forward_context
from myvllm.models.config import get_head_dim, rope_parameters
from myvllm.utils.hf_config import load_hf_config

ATOL = 1e-4


@pytest.fixture(scope="module", params=KINDS)
def pair(request):
    path = tiny_checkpoint(request.param)
    return request.param, load_ours(path), load_hf_reference(path)


def _prompts(lengths: list[int], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in lengths]


@torch.no_grad()
def _hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    return hf(torch.tensor([tokens])).logits[0]


@torch.no_grad()
def test_prefill_batch_matches_hf(pair) -> None:
    kind, ours, hf = pair
    prompts = _prompts([5, 11, 8], seed=1)
    lens = [len(p) for p in prompts]
    input_ids = torch.tensor(sum(prompts, []))
    positions = torch.cat([torch.arange(n) for n in lens])
    with forward_context(prefill_context(lens)):
        hidden = ours(input_ids, positions)
        last_logits = ours.compute_logits(hidden)
    all_logits = ours.compute_logits(hidden)  # outside prefill: one row per token
    refs = [_hf_logits(hf, p) for p in prompts]
    torch.testing.assert_close(
        all_logits, torch.cat(refs), atol=ATOL, rtol=0, msg=f"{kind}: per-token logits"
    )
    torch.testing.assert_close(
        last_logits, torch.stack([r[-1] for r in refs]), atol=ATOL, rtol=0,
        msg=f"{kind}: prefill must return only each sequence's last-token logits",
    )  # fmt: skip


class PagedCache:
    """A small per-layer paged KV cache assigned to the model's Attention modules by hand."""

    def __init__(self, model, num_blocks: int, block_size: int) -> None:
        config = model.config
        shape = (num_blocks, block_size, config.num_key_value_heads, get_head_dim(config))
        self.block_size = block_size
        attns = [m for m in model.modules() if isinstance(m, Attention)]
        assert len(attns) == config.num_hidden_layers
        for m in attns:
            m.k_cache = torch.zeros(shape)
            m.v_cache = torch.zeros(shape)

    def slots(self, block_table: list[int], positions: range) -> list[int]:
        return [
            block_table[p // self.block_size] * self.block_size + p % self.block_size
            for p in positions
        ]

    @staticmethod
    def tables(block_tables: list[list[int]]) -> torch.Tensor:
        width = max(len(t) for t in block_tables)
        return torch.tensor([t + [-1] * (width - len(t)) for t in block_tables], dtype=torch.int32)


@torch.no_grad()
def test_cached_prefix_then_decode_matches_hf(pair) -> None:
    kind, ours, hf = pair
    block_size = 4
    prompts = _prompts([10, 7, 9], seed=2)
    cached = [8, 4, 0]  # tokens of each prompt whose K/V are already in the cache (whole blocks)
    # Deliberately scattered, non-contiguous blocks (7 is sequence 0's third block).
    block_tables = [[3, 9, 7, 12], [2, 5, 0, 13], [6, 1, 10, 11]]
    cache = PagedCache(ours, num_blocks=14, block_size=block_size)
    try:
        # 1. Fill the cache with the prefixes (a plain prefill that stores K/V).
        pre = [(i, p[:c]) for i, (p, c) in enumerate(zip(prompts, cached)) if c > 0]
        lens = [len(t) for _, t in pre]
        slots = sum((cache.slots(block_tables[i], range(len(t))) for i, t in pre), [])
        with forward_context(prefill_context(
            lens, slot_mapping=torch.tensor(slots, dtype=torch.int32)
        )):
            ours(
                torch.tensor(sum((t for _, t in pre), [])),
                torch.cat([torch.arange(n) for n in lens]),
            )

        # 2. Prefill the rest over the cached prefix: positions start at num_cached.
        new = [p[c:] for p, c in zip(prompts, cached)]
        q_lens, k_lens = [len(t) for t in new], [len(p) for p in prompts]
        cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
        cu_k = torch.tensor([0, *torch.tensor(k_lens).cumsum(0).tolist()], dtype=torch.int32)
        slots = sum(
            (
                cache.slots(block_tables[i], range(c, len(p)))
                for i, (p, c) in enumerate(zip(prompts, cached))
            ),
            [],
        )
        positions = torch.cat([torch.arange(c, len(p)) for p, c in zip(prompts, cached)])
        with forward_context(Context(
            is_prefill=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(q_lens),
            max_seqlen_k=max(k_lens), slot_mapping=torch.tensor(slots, dtype=torch.int32),
            block_tables=cache.tables(block_tables),
        )):  # fmt: skip
            hidden = ours(torch.tensor(sum(new, [])), positions)
        got = ours.compute_logits(hidden)
        want = torch.cat([_hf_logits(hf, p)[c:] for p, c in zip(prompts, cached)])
        torch.testing.assert_close(
            got, want, atol=ATOL, rtol=0, msg=f"{kind}: prefill over a cached prefix"
        )

        # 3. Decode: one token per sequence (the greedy next token), compared with HF on the
        #    whole sequence so far.
        seqs = [list(p) for p in prompts]
        next_tokens = [int(want[cu_q[i + 1] - 1].argmax()) for i in range(len(seqs))]
        for step in range(3):
            for s, t in zip(seqs, next_tokens):
                s.append(t)
            positions = torch.tensor([len(s) - 1 for s in seqs])
            slots = [
                cache.slots(bt, range(len(s) - 1, len(s)))[0] for bt, s in zip(block_tables, seqs)
            ]
            with forward_context(Context(
                is_prefill=False, slot_mapping=torch.tensor(slots, dtype=torch.int32),
                context_lens=torch.tensor([len(s) for s in seqs], dtype=torch.int32),
                block_tables=cache.tables(block_tables),
            )):  # fmt: skip
                hidden = ours(torch.tensor(next_tokens), positions)
                got = ours.compute_logits(hidden)
            want = torch.stack([_hf_logits(hf, s)[-1] for s in seqs])
            torch.testing.assert_close(
                got, want, atol=ATOL, rtol=0, msg=f"{kind}: decode step {step}"
            )
            next_tokens = want.argmax(-1).tolist()
    finally:
        for m in ours.modules():
            if isinstance(m, Attention):
                m.k_cache = m.v_cache = torch.tensor([])


def test_rope_parameters_reads_both_config_forms() -> None:
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}  # fmt: skip
    v4 = SimpleNamespace(rope_theta=5e5, rope_scaling=dict(scaling))
    v5 = SimpleNamespace(rope_parameters={**scaling, "rope_theta": 5e5})
    assert rope_parameters(v4) == rope_parameters(v5) == (5e5, scaling)
    old_style = SimpleNamespace(
        rope_theta=1e6,
        rope_scaling={"type": "llama3", **{k: v for k, v in scaling.items() if k != "rope_type"}},
    )
    assert rope_parameters(old_style) == (1e6, scaling)
    assert rope_parameters(SimpleNamespace(rope_theta=1e6, rope_scaling=None)) == (1e6, None)
    assert rope_parameters(
        SimpleNamespace(rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    ) == (1e6, None)
    with pytest.raises(ValueError, match="rope_theta"):
        rope_parameters(SimpleNamespace(rope_scaling=None))


@torch.no_grad()
@pytest.mark.parametrize("kind", ["llama3", "qwen3"])
def test_transformers4_config_json_gives_same_logits(kind: str, tmp_path: Path) -> None:
    """A config.json in the transformers-4 form (rope_theta + rope_scaling) loads the same model."""
    src = tiny_checkpoint(kind)
    dst = tmp_path / kind
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    params = cfg.pop("rope_parameters", None) or {
        "rope_theta": cfg["rope_theta"],
        "rope_type": "default",
    }
    cfg["rope_theta"] = params.pop("rope_theta")
    cfg["rope_scaling"] = None if params.get("rope_type") == "default" else params
    (dst / "config.json").write_text(json.dumps(cfg))

    assert rope_parameters(load_hf_config(dst)) == rope_parameters(load_hf_config(src))
    ids = torch.tensor(_prompts([12], seed=3)[0])
    logits = []
    for path in (src, dst):
        model = load_ours(path)
        with forward_context(prefill_context([len(ids)])):
            hidden = model(ids, torch.arange(len(ids)))
        logits.append(model.compute_logits(hidden))
    torch.testing.assert_close(logits[0], logits[1], atol=0, rtol=0)
    # And both equal transformers' own model of the original checkpoint.
    expected = load_hf_reference(src)(ids[None]).logits[0]  # every position
    torch.testing.assert_close(logits[1], expected, atol=1e-4, rtol=1e-4)
